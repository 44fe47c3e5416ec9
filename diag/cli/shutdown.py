"""How a `python -m diag` run ends: without the interpreter's teardown; under torchrun, a
refusal once this node's other ranks have said theirs."""

from __future__ import annotations

import contextlib
import os
import sys
import typing
from typing import Any


def exit_now(code: int) -> typing.NoReturn:
    """Exit without the interpreter's teardown of torch (seconds), doing what an exit still does."""
    import atexit
    import ctypes
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        # the code is chosen: a launcher's SIGTERM now must not raise inside an atexit handler
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading._shutdown()  # type: ignore[attr-defined]  # Py_Finalize's order: threads, atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing can reach it
            stream.flush()
    ctypes.CDLL(None).fflush(None)  # a C library's printf buffer
    os._exit(code)


def said() -> None:
    """Under torchrun's agent (which stops every rank once one exits), a refusing rank waits up
    to timeout_s("say") until this node's other ranks have said theirs (a marker each) or ended."""
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
