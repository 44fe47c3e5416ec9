"""How a finished `python -m diag` run ends: without the interpreter's teardown."""

from __future__ import annotations

import os
import sys
import typing


def exit_now(code: int) -> typing.NoReturn:
    """End a finished CLI run without the interpreter's teardown of torch, transformers and the
    rest: 0.9 s after importing torch alone, 2.6 s after the QLoRA stack, measured here, paid on
    every run for nothing. By the time main() returns every `with` block has closed (servers
    stopped, files renamed into place); what a normal exit still does is done here, in its order:
    join the threads that are not daemons, run the atexit handlers (logging's flush, temporary
    folders' finalizers), flush Python's and C's output buffers. A run that raised (a traceback,
    SIGTERM's SystemExit) never gets here and exits the usual way."""
    import atexit
    import ctypes
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        # the run is over and its code chosen: a SIGTERM now (a launcher stopping the ranks
        # that are left) must not raise SystemExit inside an atexit handler as a traceback
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    ctypes.CDLL(None).fflush(None)  # a C library's printf buffer
    os._exit(code)
