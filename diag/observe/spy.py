"""`diag attach PID`: where a running training job's wall clock goes, without touching it.

py-spy samples the job's Python stacks, its DataLoader workers' too, in chunks of CHUNK_S (the
view updates after each); the main thread's samples become stages by rules.RULES, one row per
stage of a StageTimer frame (a window of the run, no step numbers) that amdahl reads like any
run. psutil reads the processes' /proc CPU and I/O counters, NVML the GPUs the job holds.
Read-only: py-spy runs --nonblocking, reading the job's memory; it never pauses or signals it.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from diag.config import AttachConfig
from diag.observe import gpus
from diag.observe.rules import classify, parse_frame
from diag.observe.story import WIDE, interval, story

CHUNK_S = 2.0  # py-spy runs this long per call: the live view's refresh; starting costs ~50 ms
_PREP = re.compile(r"torch/utils/data/_utils/fetch\.py")  # a worker making a batch
_FIX = ("run diag as root (sudo), give it CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE), "
        "or allow ptrace: sudo sysctl kernel.yama.ptrace_scope=0 (docs/attach.md)")


@dataclass
class Attached:
    attach: pd.DataFrame  # per stage: wall seconds, share and its 95% interval, samples, rule
    stages: pd.DataFrame  # the StageTimer frame: stage, seconds, step (NaN), rank, node, run
    verdict: pd.DataFrame  # one row: amdahl's verdict, the top fix, the upgrade, notes
    fixes: pd.DataFrame | None  # amdahl.findings (None: no stage worth a fix)
    workers: pd.DataFrame  # what the child processes (DataLoader workers) spent samples on
    gpu: pd.DataFrame  # NVML: each GPU the job holds, its utilisation and the job's memory
    process: pd.DataFrame  # /proc: CPU seconds and bytes read/written per process
    projection: pd.DataFrame | None  # amdahl.upgrade to the target GPU (None: no known GPU)


def _py_spy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("py-spy is not installed: pip install 'diag[attach]' (py-spy 0.4)")
    return found


def _realtime() -> None:
    """In py-spy's process before it starts: the lowest real-time priority where allowed
    (root, CAP_SYS_NICE). On a saturated CPU a sampler at normal priority runs when the job
    blocks, not while it computes, and over-counts its waits (docs/calibration.md)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):  # not allowed, or not Linux: normal priority
        pass


def _spy(spy: str, pid: int, seconds: float, rate: int, out: Path, *options: str
         ) -> subprocess.Popen:
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--duration", str(max(round(seconds), 1)),
         "--rate", str(rate), "--output", str(out), "--nonblocking", "--idle", "--threads",
         "--full-filenames", *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, preexec_fn=_realtime)


def realtime_allowed() -> bool:
    """Whether py-spy can get its real-time priority here (else the verdict's note says so)."""
    import psutil

    try:
        return os.geteuid() == 0 or psutil.Process().rlimit(psutil.RLIMIT_RTPRIO)[0] > 0
    except (AttributeError, OSError):
        return False


def _sample(spy: str, pid: int, seconds: float, rate: int
            ) -> tuple[collections.Counter, collections.Counter, bool]:
    """One chunk: (the main thread's seconds by stack, from py-spy's chrome trace, each sample
    weighted by the time to the next, so a sampler that falls behind on a busy CPU does not
    tilt the shares; the children's sample counts by (process, thread, stack); whether the
    process exited). Two py-spy runs: its chrome trace keys a thread by its pthread id, which a
    forked worker shares with its parent's main thread."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="diag-attach-") as tmp:
        main, kids = Path(tmp) / "main.json", Path(tmp) / "kids.txt"
        runs = [_spy(spy, pid, seconds, rate, main, "--format", "chrometrace")]
        if psutil.Process(pid).children():
            runs.append(_spy(spy, pid, seconds, max(rate // 4, 10), kids, "--format", "raw",
                             "--subprocesses"))
        said = [run.communicate(timeout=seconds + 60)[0] for run in runs]
        if runs[0].returncode != 0 or not main.exists():
            _refuse(pid, said[0])
        timeline = _timeline(json.loads(main.read_text() or "[]"), pid)
        counts = collections.Counter({_key(line): int(line.rsplit(" ", 1)[1])
                                      for line in (kids.read_text().splitlines()
                                                   if kids.exists() else ()) if line.strip()})
    return timeline, counts, "process exited" in said[0]


def _timeline(events: list[dict], pid: int) -> collections.Counter:
    """Seconds per stack (outermost frame first) of process pid's main thread."""
    stacks: dict[int, list[str]] = collections.defaultdict(list)
    last: dict[int, float] = {}
    out: collections.Counter = collections.Counter()
    for e in events:
        tid, ts, stack = e["tid"], e["ts"] / 1e6, stacks[e["tid"]]
        if stack and stack[0].startswith(f"thread ({pid})"):
            out[tuple(stack[1:])] += ts - last[tid]
        last[tid] = ts
        where = e.get("args") or {}
        frame = f"{e['name']} ({where['filename']}:{where.get('line', 0)})" \
            if where.get("filename") else e["name"]
        if e["ph"] == "B":
            stack.append(frame)
        elif stack:
            stack.pop()
    return out


def _refuse(pid: int, said: str) -> None:
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


def _key(line: str) -> tuple[int, int, tuple[str, ...]]:
    """A raw line's (its process, its thread, its frames outermost first)."""
    stack = line.rsplit(" ", 1)[0]
    cut = stack.find(";thread (") + 1 if not stack.startswith("thread (") else 0
    pids = re.findall(r'(?:^|;)process (\d+):"', stack[:cut])
    parts = stack[cut:].split(";")
    tid = re.match(r"thread \((\d+)\)", parts[0])
    frames = tuple(p for p in parts if not p.startswith("thread ("))
    return int(pids[-1]) if pids else 0, int(tid[1]) if tid else 0, frames


def _stages(timeline: collections.Counter) -> collections.Counter:
    """The main thread's seconds by (stage, the source of the rule that named it)."""
    out: collections.Counter = collections.Counter()
    for frames, seconds in timeline.items():
        out[classify(list(frames))] += seconds
    return out


def _workers(counts: collections.Counter, pid: int) -> pd.DataFrame:
    """Each child's main-thread samples: the leaf function while it makes a batch, else waits."""
    rows: collections.Counter = collections.Counter()
    for (owner, tid, frames), n in counts.items():
        if owner != pid and tid == owner and frames:
            function, file, _ = parse_frame(frames[-1])
            making = any(_PREP.search(parse_frame(f)[1]) for f in frames)
            rows[(owner, function if making else "(waiting for work, or handing a batch over)",
                  file if making else "")] += n
    table = pd.DataFrame([(*k, n) for k, n in rows.items()],
                         columns=["pid", "function", "file", "samples"])
    if table.empty:
        return table.assign(share=[])
    table["share"] = table["samples"] / table.groupby("pid")["samples"].transform("sum")
    return table.sort_values(["pid", "samples"], ascending=[True, False], ignore_index=True)


def _counters(pid: int) -> dict[int, tuple[str, float, float, float]]:
    """/proc through psutil: pid -> (role, CPU seconds, MB read, MB written) of the job and its
    children; counters a process does not let us read are NaN."""
    import psutil

    out = {}
    try:
        main = psutil.Process(pid)
        family = [main, *main.children(recursive=True)]
    except psutil.Error:
        return out
    for p in family:
        try:
            cpu = p.cpu_times()
            role = "main" if p.pid == pid else "child"
            try:
                io = p.io_counters()
                read, written = io.read_bytes / 1e6, io.write_bytes / 1e6
            except (psutil.Error, AttributeError):
                read = written = float("nan")
            out[p.pid] = (role, cpu.user + cpu.system, read, written)
        except psutil.Error:
            continue
    return out


def _process(before: dict, after: dict, window: float) -> pd.DataFrame:
    rows = []
    for pid, (role, cpu, read, written) in after.items():
        was = before.get(pid, (role, 0.0, 0.0, 0.0))  # a child started meanwhile: from zero
        rows.append({"pid": pid, "role": role, "cpu_s": cpu - was[1],
                     "cpu_cores": (cpu - was[1]) / window if window else float("nan"),
                     "read_mb": read - was[2], "written_mb": written - was[3]})
    return pd.DataFrame(rows, columns=["pid", "role", "cpu_s", "cpu_cores", "read_mb",
                                       "written_mb"])


def _table(by: collections.Counter, rate: int) -> pd.DataFrame:
    """Per stage: its sampled wall seconds, its share, the samples (seconds x rate) and the
    95% interval they give, the rule that named most of it."""
    total = sum(by.values())
    rows = []
    for stage in dict.fromkeys(s for s, _ in sorted(by, key=lambda k: -by[k])):
        seconds = sum(v for (s, _), v in by.items() if s == stage)
        share = seconds / total
        low, high = interval(round(seconds * rate), round(total * rate))
        rule = max(((src, v) for (s, src), v in by.items() if s == stage), key=lambda t: t[1])[0]
        rows.append({"stage": stage, "seconds": seconds, "share": share, "low": low,
                     "high": high, "samples": round(seconds * rate), "rule": rule,
                     "note": f"few samples: {low:.0%} to {high:.0%}"
                     if max(high - share, share - low) > WIDE else ""})
    return pd.DataFrame(rows)


def live_line(by: collections.Counter) -> str:
    """The shares so far, largest first: what the live view shows after each chunk."""
    total = sum(by.values()) or 1.0
    shares: collections.Counter = collections.Counter()
    for (stage, _), seconds in by.items():
        shares[stage] += seconds / total
    return ", ".join(f"{s} {v:.0%}" for s, v in shares.most_common(4))


def run_attach(cfg: AttachConfig, progress: bool = True) -> Attached:
    """Sample process cfg.pid for cfg.seconds (less if it exits: what was sampled is kept)."""
    import psutil
    from tqdm.auto import tqdm

    spy = _py_spy()
    if not psutil.pid_exists(cfg.pid):
        raise ValueError(f"AttachConfig.pid={cfg.pid}: no such process (`ps -ef | grep python`, "
                         "nvidia-smi list the candidates)")
    done = subprocess.run([spy, "dump", "--pid", str(cfg.pid), "--nonblocking"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:  # one line, before any sampling
        _refuse(cfg.pid, done.stdout + done.stderr)
    timeline: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    before, exited = _counters(cfg.pid), False
    with gpus.Watch(cfg.pid) as gpu, tqdm(total=cfg.seconds, unit="s", disable=not progress,
                                         desc=f"attach {cfg.pid}") as bar:
        start = time.perf_counter()
        while not exited and (left := cfg.seconds - (time.perf_counter() - start)) >= 0.5:
            try:
                main, kids, exited = _sample(spy, cfg.pid, min(CHUNK_S, left), cfg.rate)
            except (ValueError, psutil.NoSuchProcess):  # gone between two chunks
                if not timeline:
                    raise ValueError(f"AttachConfig.pid={cfg.pid}: the process ended before it "
                                     "was sampled") from None
                main, kids, exited = collections.Counter(), collections.Counter(), True
            timeline.update(main)
            counts.update(kids)
            bar.update(min(time.perf_counter() - start, cfg.seconds) - bar.n)
            bar.set_postfix_str(live_line(_stages(timeline)))
        window = time.perf_counter() - start
        after = _counters(cfg.pid)
    by = _stages(timeline)
    if not by:
        raise RuntimeError(f"process {cfg.pid} " + ("exited before a sample of its main thread "
                           "was taken" if exited else "gave py-spy no sample of its main thread"))
    notes = [f"process {cfg.pid} exited {window:.3g} s into the {cfg.seconds:g} s asked for: "
             f"the stages rest on the {sum(by.values()):.3g} s sampled before"] if exited else []
    if not realtime_allowed():
        notes.append("py-spy ran at normal priority (no root or CAP_SYS_NICE): on a busy CPU "
                     "the waits may be over-counted")
    note = "; ".join(notes)
    table = _table(by, cfg.rate)
    frame = pd.DataFrame({"stage": table["stage"], "seconds": table["seconds"],
                          "step": pd.array([pd.NA] * len(table), dtype="Int64"), "rank": 0,
                          "node": 0, "run": "attach"})
    current = cfg.current_gpu or gpu.known_name()
    verdict, fixes, projection = story(frame, current, cfg.target_gpu, note)
    return Attached(table, frame, verdict, fixes, _workers(counts, cfg.pid), gpu.frame(),
                    _process(before, {**before, **after}, window), projection)


def attach(pid: int, seconds: float = 60.0, rate: int = 100, current_gpu: str = "",
           target_gpu: str = "H100 SXM", progress: bool = True) -> Attached:
    """Sample a running training process (never pausing or signalling it) and say where its
    wall clock goes: `diag attach PID` in a notebook, its shares shown as it samples."""
    return run_attach(AttachConfig(pid=pid, seconds=seconds, rate=rate, current_gpu=current_gpu,
                                   target_gpu=target_gpu), progress)
