"""How a `python -m diag` run ends: without the interpreter's teardown; under torchrun, a
refusal once this node's other ranks have said theirs."""

from __future__ import annotations

import os
import sys
import typing
from typing import Any


def exit_now(code: int) -> typing.NoReturn:
    """End a CLI run without the interpreter's teardown of torch and the rest (seconds, for
    nothing), doing what a normal exit still does, in its order: join the threads that are not
    daemons, run the atexit handlers, flush Python's and C's buffers. A run that raised
    (SIGTERM's SystemExit) exits the usual way."""
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


def said() -> None:
    """Under torchrun's agent, a rank that refuses before its run starts waits, up to
    timeout_s("say"), until this node's other ranks have said theirs too (a marker file each)
    or ended: the agent stops every rank once one exits."""
    import tempfile
    import time
    from pathlib import Path

    import psutil

    from diag.files import temp_path
    from diag.timing.distributed import spilled, timeout_s

    if spilled() is not None or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    try:
        others = [p for p in psutil.Process(os.getppid()).children() if p.pid != os.getpid()]
    except psutil.Error:  # no parent left to ask
        return
    base = Path(tempfile.gettempdir()) / f"diag-said-{os.getppid()}"
    mark = temp_path(base)  # its name carries this pid: swept by a later start if left behind
    mark.touch()
    deadline = time.monotonic() + timeout_s("say")
    try:
        while others and time.monotonic() < deadline:
            time.sleep(0.1)
            others = [p for p in others if _running(p) and not any(
                base.parent.glob(f".{base.name}.tmp-{p.pid}-*"))]
    finally:
        mark.unlink(missing_ok=True)


def _running(process: Any) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
