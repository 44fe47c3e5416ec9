"""Jobs diag did not start, as the stage table, amdahl's verdict, fixes and upgrade projection:
`trace(*files)` reads torch.profiler traces (kineto.py); `attach(pid)` samples the process with
py-spy, read-only, in CHUNK_S chunks; a stack's stage is the first of RULES any frame matches
(none: `other`); psutil reads /proc, NVML the job's GPUs (docs/attach.md).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import linecache
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import psutil

from diag.runner import quietly
from diag.config import AttachConfig
from diag.machine.contention import Watch, counters
from diag.observe.kineto import run_trace, story, trace

__all__ = ["RULES", "attach", "classify", "run_attach", "run_trace", "trace"]

CHUNK_S = 2.0  # py-spy runs this long per call: the live view's refresh
_PREP = re.compile(r"torch/utils/data/_utils/fetch\.py")  # a worker making a batch
_WAITING = "(waiting for work, or handing a batch over)"
WIDE = 0.05  # a sampled share whose 95% interval reaches further than this either side says so
_FIX = ("run diag as root (sudo), give it CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE), "
        "or allow ptrace: sudo sysctl kernel.yama.ptrace_scope=0 (docs/attach.md)")


class Rule(NamedTuple):
    stage: str
    file: str  # regex searched in the frame's path ("" = any file)
    function: str  # regex the frame's function name (its last dotted part) must match whole
    source: str  # where the rule comes from
    code: str = ""  # regex searched in the executing line of a leaf frame in the user's own code


_PL, _TR, _ACC = "PyTorch Lightning", "transformers Trainer", "accelerate"
RULES: tuple[Rule, ...] = (
    Rule("warmup", r"^<frozen importlib|torch/_dynamo/convert_frame\.py"
         r"|torch/_inductor/compile_fx\.py", ".*", "imports (torch's lazy ones), compile"),
    Rule("load_model", r"transformers/modeling_utils\.py", "from_pretrained", "transformers"),
    Rule("eval", r"transformers/trainer\.py", r"evaluate|evaluation_loop|prediction_step", _TR),
    Rule("eval", r"lightning/pytorch/loops/evaluation_loop\.py", ".*", _PL),
    Rule("eval", "", "estimate_loss", "nanoGPT train.py estimate_loss()"),
    Rule("checkpoint", r"torch/serialization\.py|safetensors/", r"save|save_file|save_model",
         "torch.save, safetensors"),
    Rule("checkpoint", r"transformers/trainer\.py", "_save_checkpoint|save_model", _TR),
    Rule("checkpoint", r"accelerate/accelerator\.py", "save_state|save_model", _ACC),
    Rule("checkpoint", r"lightning/", "save_checkpoint", _PL),
    Rule("comm_wait", r"torch/distributed/(distributed_c10d|_functional_collectives)\.py", ".*",
         "torch.distributed"),
    Rule("comm_wait", r"torch/nn/parallel/distributed\.py", "_sync_buffers|_sync_module_buffers",
         "DDP's buffer broadcast at forward"),
    Rule("comm_wait", r"accelerate/", "wait_for_everyone|gather|reduce|broadcast", _ACC),
    Rule("comm_wait", r"lightning/", "barrier|all_gather|reduce|broadcast", _PL),
    Rule("h2d", r"accelerate/utils/operations\.py", "send_to_device", _ACC),
    Rule("h2d", r"transformers/trainer\.py", "_prepare_inputs?", _TR),
    Rule("h2d", r"lightning/", "batch_to_device|transfer_batch_to_device|move_data_to_device", _PL),
    Rule("h2d", "", "", "a plain loop's x.to(device) (nanoGPT get_batch)", r"\.(to|cuda)\("),
    Rule("data_wait", r"torch/utils/data/dataloader\.py", "__next__", "torch DataLoader"),
    Rule("data_wait", r"accelerate/data_loader\.py", "__iter__|__next__", _ACC),
    Rule("data_wait", r"transformers/trainer\.py", "get_batch_samples", _TR),
    Rule("data_wait", r"lightning/pytorch/loops/fetchers\.py", ".*", _PL),
    Rule("data_wait", "", "get_batch", "nanoGPT train.py get_batch()"),
    Rule("compute", r"torch/(nn|optim|autograd|amp|_dynamo|_inductor|_functorch)/"
         r"|torch/_tensor\.py|torch/functional\.py", ".*", "torch forward, backward, step"),
    Rule("compute", r"transformers/trainer\.py", "training_step|compute_loss", _TR),
    Rule("compute", r"accelerate/accelerator\.py", "backward", _ACC),
    Rule("compute", r"lightning/", "training_step|optimizer_step|backward|_run_optimization", _PL),
    Rule("compute", r"peft/|bitsandbytes/|transformers/models/", ".*", "model code"),
    Rule("compute", "", "", "a plain loop's loss.backward(), optimizer.step(), loss.item() (a "
         "device sync)", r"\.(item|backward|step)\("),
)
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_INSTALLED = re.compile(r"/(site|dist)-packages/|/lib/python3\.\d+/")


def parse_frame(frame: str) -> tuple[str, str, int]:
    """py-spy's `function (file:line)` as (function, file, line); line 0 when absent."""
    got = _FRAME.match(frame)
    return (frame, "", 0) if got is None else (
        got["function"], got["file"].replace("\\", "/"), int(got["line"] or 0))


@functools.lru_cache(maxsize=4096)
def _matches(rule: Rule, frame: str, leaf: bool) -> bool:
    function, file, line = parse_frame(frame)
    if rule.code:  # the executing line of the user's own code (a library's is not read)
        if not leaf or not line or _INSTALLED.search(file):
            return False
        return re.search(rule.code, linecache.getline(file, line)) is not None
    return (re.search(rule.file, file) is not None
            and re.fullmatch(rule.function, function.rsplit(".", 1)[-1]) is not None)


def classify(frames: list[str]) -> tuple[str, str]:
    """(stage, its rule's source) of one stack, outermost frame first; ("other", "") for none."""
    for rule in RULES:
        if any(_matches(rule, f, i == len(frames) - 1) for i, f in enumerate(frames)):
            return rule.stage, rule.source
    return "other", ""


def _realtime() -> None:
    """In py-spy's process: real-time priority where allowed (a busy CPU over-counts waits)."""
    with contextlib.suppress(OSError, AttributeError):  # not root (or CAP_SYS_NICE), not Linux
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))


def _check(spy: str, pid: int) -> None:
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
    _refuse(pid, said)


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


def _sample(spy: str, pid: int, seconds: float, rate: int, children: bool
           ) -> tuple[collections.Counter, collections.Counter, bool]:
    """(main thread's seconds by stack, children's raw counts by (pid, tid, stack), exited?)."""
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
            _refuse(pid, said[0])
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


@dataclass
class Attached:
    attach: pd.DataFrame  # per stage: wall seconds, share and its 95% interval, samples, rule
    stages: pd.DataFrame  # the StageTimer frame: stage, seconds, step (NaN), rank, node, run
    verdict: pd.DataFrame  # one row: amdahl's verdict, the top fix, the upgrade, notes
    fixes: pd.DataFrame | None  # amdahl.findings (None: no stage worth a fix)
    workers: pd.DataFrame | None  # what the children (DataLoader workers) were sampled in
    gpu: pd.DataFrame  # NVML: each GPU the job holds, its utilisation and the job's memory
    process: pd.DataFrame  # /proc: CPU seconds and MB read and written per process
    projection: pd.DataFrame | None  # amdahl.upgrade to the target GPU (None: no known GPU)


def interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval of a share k/n (samples as independent: long runs are less sure)."""
    if n <= 0:
        return float("nan"), float("nan")
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def _table(timeline: collections.Counter, rate: int) -> pd.DataFrame:
    """Per stage, largest first: sampled seconds, share and its 95% interval, samples, main rule."""
    by: collections.Counter = collections.Counter()  # (stage, its rule's source): seconds
    for frames, seconds in timeline.items():
        if seconds > 0:
            by[classify(list(frames))] += seconds
    per: collections.Counter = collections.Counter()
    for (stage, _), seconds in by.items():
        per[stage] += seconds
    total, rows = sum(per.values()), []
    for stage, seconds in per.most_common():
        mine = {src: v for (s, src), v in by.items() if s == stage}
        share, (low, high) = seconds / total, interval(round(seconds * rate), round(total * rate))
        rows.append([stage, seconds, share, low, high, round(seconds * rate),
                     max(mine, key=mine.get), f"few samples: {low:.0%} to {high:.0%}"
                     if max(high - share, share - low) > WIDE else ""])
    return pd.DataFrame(rows, columns=["stage", "seconds", "share", "low", "high", "samples",
                                       "rule", "note"])


def _workers(counts: collections.Counter, pid: int) -> pd.DataFrame | None:
    """Each child's main-thread samples: the leaf function while it makes a batch, else waits."""
    rows: collections.Counter = collections.Counter()
    for (owner, tid, frames), n in counts.items():
        if owner != pid and tid == owner and frames:
            function, file, _ = parse_frame(frames[-1])
            making = any(_PREP.search(parse_frame(f)[1]) for f in frames)
            rows[(owner, function if making else _WAITING, file if making else "")] += n
    table = pd.DataFrame([(*k, n) for k, n in rows.items()],
                         columns=["pid", "function", "file", "samples"])
    if table.empty:  # no child process was sampled
        return None
    table["share"] = table["samples"] / table.groupby("pid")["samples"].transform("sum")
    return table.sort_values(["pid", "samples"], ascending=[True, False], ignore_index=True)


@quietly
def run_attach(cfg: AttachConfig, progress: bool = True) -> Attached:
    """Sample process cfg.pid for cfg.seconds (less if it exits: what was sampled is kept)."""
    from tqdm.auto import tqdm

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise RuntimeError("py-spy is not installed: pip install 'diag[attach]' (py-spy 0.4)")
    if not psutil.pid_exists(cfg.pid):
        raise ValueError(f"AttachConfig.pid={cfg.pid}: no such process (`ps -ef | grep python`, "
                         "nvidia-smi list the candidates)")
    _check(spy, cfg.pid)
    timeline, counts = collections.Counter(), collections.Counter()
    before, exited = counters(cfg.pid), False
    with Watch(cfg.pid) as gpu, tqdm(total=cfg.seconds, unit="s", disable=not progress,
                                         desc=f"attach {cfg.pid}") as bar:
        start = time.perf_counter()
        while not exited and (left := cfg.seconds - (time.perf_counter() - start)) >= 0.5:
            try:
                kids = bool(psutil.Process(cfg.pid).children())
                main, got, exited = _sample(spy, cfg.pid, min(CHUNK_S, left), cfg.rate, kids)
            except (ValueError, psutil.NoSuchProcess):  # gone between two chunks
                main, got, exited = collections.Counter(), collections.Counter(), True
            timeline.update(main)
            counts.update(got)
            bar.update(min(time.perf_counter() - start, cfg.seconds) - bar.n)
            shares = _table(timeline, 1)[:4]  # the live view: the largest shares so far
            bar.set_postfix_str(", ".join(f"{s} {v:.0%}" for s, v in zip(shares["stage"],
                                                                        shares["share"])))
        window = time.perf_counter() - start
        after = {**before, **counters(cfg.pid)}
    table = _table(timeline, cfg.rate)
    if table.empty:
        raise RuntimeError(f"process {cfg.pid} exited before its main thread was sampled")
    sampled = table["seconds"].sum()
    notes = [f"process {cfg.pid} exited {window:.3g} s into the {cfg.seconds:g} s asked for: "
             f"the stages rest on the {sampled:.3g} s sampled before"] if exited else []
    if os.geteuid() != 0:
        notes.append("py-spy ran at normal priority (not root): on a busy CPU the waits may be "
                     "over-counted")
    frame = pd.DataFrame({"stage": table["stage"], "seconds": table["seconds"],
                          "step": pd.array([pd.NA] * len(table), dtype="Int64"), "rank": 0,
                          "node": 0, "run": "attach"})
    held = gpu.rows[0][1] if gpu.rows else ""  # the first GPU the job held: the upgrade's
    verdict, fixes, projection = story(frame, cfg.current_gpu or held, cfg.target_gpu,
                                       "; ".join(notes))
    process = pd.DataFrame([  # per process: what it took in the window (a new child: from zero)
        {"pid": pid, "role": role, "cpu_s": cpu - was[1], "cpu_cores": (cpu - was[1]) / window,
         "read_mb": read - was[2], "written_mb": written - was[3]}
        for pid, (role, cpu, read, written) in after.items()
        for was in [before.get(pid, (role, 0.0, 0.0, 0.0))]],
        columns=["pid", "role", "cpu_s", "cpu_cores", "read_mb", "written_mb"])
    return Attached(table, frame, verdict, fixes, _workers(counts, cfg.pid), gpu.frame(), process,
                    projection)


def attach(pid: int, progress: bool = True, **settings: Any) -> Attached:
    """Sample a running training process, never pausing it; settings: AttachConfig's."""
    return run_attach(AttachConfig(pid=pid, **settings), progress)
