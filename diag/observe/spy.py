"""py-spy, read-only: one chunk of samples of a running process, never pausing or signalling it:
the main thread from its chrome trace (each sample weighted by the time to the next), the children
from raw counts (a forked worker shares its parent's pthread id), real-time priority where allowed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_FIX = ("run diag as root (sudo), give it CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE), "
        "or allow ptrace: sudo sysctl kernel.yama.ptrace_scope=0 (docs/attach.md)")


def py_spy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("py-spy is not installed: pip install 'diag[attach]' (py-spy 0.4)")
    return found


def _realtime() -> None:
    """In py-spy's process: real-time priority where allowed (a busy CPU over-counts waits)."""
    with contextlib.suppress(OSError, AttributeError):  # not root (or CAP_SYS_NICE), not Linux
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))


def check(spy: str, pid: int) -> None:
    """One `py-spy dump` of pid: a refusal is one line before any sampling."""
    for _ in range(5):  # a nonblocking dump can race the interpreter changing its threads
        done = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"],
                              capture_output=True, text=True, timeout=60)
        said = done.stdout + done.stderr
        if done.returncode == 0:
            return
        if "Failed to get stack traces" not in said:
            break
        time.sleep(0.2)
    refuse(pid, said)


def refuse(pid: int, said: str) -> None:
    """py-spy's failure as one line."""
    if "Permission Denied" in said or "Operation not permitted" in said:
        raise PermissionError(f"ptrace of process {pid} was refused: {_FIX}")
    if re.search(r"python version|python interpreter|no python processes", said, re.I):
        raise ValueError(f"AttachConfig.pid={pid}: not a Python process (py-spy found no "
                         "interpreter in it): give the PID of the training script")
    if "No such file" in said or "not running" in said.lower():
        raise ValueError(f"AttachConfig.pid={pid}: the process ended before it was sampled")
    last = [line for line in said.splitlines() if line.startswith("Error")] or ["no output"]
    raise RuntimeError(f"py-spy could not sample process {pid}: {last[0]}")


def sample(spy: str, pid: int, seconds: float, rate: int, children: bool
           ) -> tuple[collections.Counter, collections.Counter, bool]:
    """(main thread's seconds by stack, children's counts by (pid, tid, stack), exited?)."""
    with tempfile.TemporaryDirectory(prefix="diag-attach-") as tmp:
        main, kids = Path(tmp) / "main.json", Path(tmp) / "kids.txt"
        runs = [(main, rate, ["--format", "chrometrace"])]
        if children:
            runs.append((kids, max(rate // 4, 10), ["--format", "raw", "--subprocesses"]))
        spies = [subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--duration", str(max(round(seconds), 1)),
             "--rate", str(r), "--output", str(out), "--nonblocking", "--idle", "--threads",
             "--full-filenames", *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, preexec_fn=_realtime) for out, r, options in runs]
        said = [s.communicate(timeout=seconds + 60)[0] for s in spies]
        if spies[0].returncode != 0 or not main.exists():
            refuse(pid, said[0])
        timeline = _timeline(json.loads(main.read_text() or "[]"), pid)
        lines = kids.read_text().splitlines() if kids.exists() else []
        counts = collections.Counter({_key(x): int(x.rsplit(" ", 1)[1]) for x in lines if x})
    return timeline, counts, "process exited" in said[0]


def _timeline(events: list[dict], pid: int) -> collections.Counter:
    """Seconds per stack of process pid's main thread, from the chrome trace's B/E events."""
    stacks: dict[int, list[str]] = collections.defaultdict(list)
    last: dict[int, float] = {}
    out: collections.Counter = collections.Counter()
    for e in events:
        tid, ts, stack = e["tid"], e["ts"] / 1e6, stacks[e["tid"]]
        if stack and stack[0].startswith(f"thread ({pid})"):
            out[tuple(stack[1:])] += ts - last[tid]
        last[tid] = ts
        where = e.get("args") or {}
        if e["ph"] == "B":
            stack.append(f"{e['name']} ({where['filename']}:{where.get('line', 0)})"
                         if where.get("filename") else e["name"])
        elif stack:
            stack.pop()
    return out


def _key(line: str) -> tuple[int, int, tuple[str, ...]]:
    """A raw line's (its process, its thread, its frames)."""
    stack = line.rsplit(" ", 1)[0]
    cut = stack.find(";thread (") + 1 if not stack.startswith("thread (") else 0
    pids = re.findall(r'(?:^|;)process (\d+):"', stack[:cut])
    parts = stack[cut:].split(";")
    tid = re.match(r"thread \((\d+)\)", parts[0])
    frames = tuple(p for p in parts if not p.startswith("thread ("))
    return int(pids[-1]) if pids else 0, int(tid[1]) if tid else 0, frames
