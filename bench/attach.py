"""How true, and how cheap, is `diag attach`; how true is `diag trace`? Side by side in one run.

attach_share_error: over the known scripts (diag's toy loop with a busy DataLoader worker, the
toy with its preparation asleep in the loop, a nanoGPT-shaped loop pausing in time.sleep), each
attached until it exits, the worst absolute gap between a step stage's share and the script's
own in-process figure (data_wait and compute; other too for the plain loop). attach_overhead: a
steady training loop's step while sampled over its step while not, in interleaved windows; the
CPU clock (the project's clock on a CPU box: neighbours move wall seconds), the wall beside.
trace_share_error: the toy under torch.profiler, diag trace against the toy's own figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import pandas as pd  # noqa: E402

from diag import amdahl  # noqa: E402
from diag.observe import attach, trace  # noqa: E402

JOBS = ROOT / "tests" / "observe"  # the known scripts the tests attach to
STEP = ["data_wait", "h2d", "compute", "comm_wait", "other"]
TOYS = {  # the toy loop's settings: a worker busy in Python, and preparation asleep in the loop
    "toy, 1 busy worker": {"steps": 300, "warmup_steps": 1, "prep_ms": 12, "prep": "busy",
                           "num_workers": 1, "device": "cpu", "width": 256, "batch_size": 64},
    "toy, asleep in the loop": {"steps": 300, "warmup_steps": 1, "prep_ms": 15,
                                "device": "cpu", "width": 512, "batch_size": 64}}
RATE = 250  # samples per second while measuring truth (the default 100 is for long attaches)
WINDOW_S, ROUNDS = 4.0, 8  # overhead: each round one sampled and one plain window, order flipped
STEADY = """
import sys, time, torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 1))
opt = torch.optim.AdamW(m.parameters())
x = torch.randn(64, 512)
m(x).mean().backward(); opt.step()
print("ready", flush=True)
while True:
    t, c = time.perf_counter(), time.thread_time()
    time.sleep(0.004)  # the step's data wait
    m(x).square().mean().backward(); opt.step(); opt.zero_grad()
    print(time.perf_counter(), time.perf_counter() - t, time.thread_time() - c, flush=True)
"""


def shares(seconds: pd.Series, leave_out: tuple[str, ...] = ()) -> pd.Series:
    part = seconds[seconds.index.isin(STEP) & ~seconds.index.isin(leave_out)]
    return part / part.sum()


def started(*args: str) -> subprocess.Popen:
    job = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "ready"
    return job


def attach_errors(tmp: Path) -> dict[str, float]:
    """Each known script's worst share gap, attached until it exits."""
    out = {}
    for name, cfg in TOYS.items():
        job = started(str(JOBS / "known_job.py"), str(tmp / "truth.csv"), json.dumps(cfg))
        got = attach(job.pid, seconds=300, rate=RATE, progress=False)
        job.wait()
        own = amdahl.shares(pd.read_csv(tmp / "truth.csv")).set_index("stage")["seconds"]
        # the window's other also holds the run's edges (worker start, shutdown): split compared
        a = shares(got.attach.set_index("stage")["seconds"], ("other",))
        t = shares(own, ("other",))
        out[name] = max(abs(a.get(s, 0.0) - t.get(s, 0.0)) for s in ("data_wait", "compute"))
    job = started(str(JOBS / "nanogpt_loop.py"), str(tmp / "truth.json"), "6")
    got = attach(job.pid, seconds=300, rate=RATE, progress=False)
    job.wait()
    a = shares(got.attach.set_index("stage")["seconds"])
    t = shares(pd.Series(json.loads((tmp / "truth.json").read_text())))
    out["nanoGPT-shaped loop"] = max(abs(a.get(s, 0.0) - t.get(s, 0.0))
                                     for s in ("data_wait", "compute", "other"))
    return out


def trace_errors(tmp: Path) -> dict[str, float]:
    out = {}
    for name, cfg in TOYS.items():
        subprocess.run([sys.executable, str(JOBS / "known_job.py"), str(tmp / "truth.csv"),
                        json.dumps({**cfg, "steps": 120}), str(tmp / "trace.json")],
                       check=True, stdout=subprocess.DEVNULL)
        got = shares(amdahl.shares(trace(tmp / "trace.json").stages).set_index("stage")[
            "seconds"])
        own = shares(amdahl.shares(pd.read_csv(tmp / "truth.csv")).set_index("stage")[
            "seconds"])
        out[name] = max(abs(got.get(s, 0.0) - own.get(s, 0.0)) for s in ("data_wait", "compute"))
    return out


def overhead() -> tuple[tuple[float, ...], tuple[float, ...], int]:
    """Per round, the median step sampled over the median step not (CPU, then wall seconds):
    the median of the rounds and their range; and the steps measured."""
    job = started("-c", STEADY)
    steps: list[tuple[float, float, float]] = []
    reader = threading.Thread(target=lambda: steps.extend(
        tuple(map(float, line.split())) for line in job.stdout), daemon=True)
    reader.start()
    windows: list[tuple[bool, float, float]] = []
    try:
        for i in range(2 * ROUNDS):
            sampled = (i % 2 == 0) == (i // 2 % 2 == 0)  # ABBA: each order as often
            start = time.perf_counter()
            if sampled:
                attach(job.pid, seconds=WINDOW_S, progress=False)
            else:
                time.sleep(WINDOW_S)
            windows.append((sampled, start, time.perf_counter()))
    finally:
        job.kill()
        job.wait()
    out = []
    for column in (2, 1):  # CPU, then wall seconds per step
        medians = [statistics.median([s[column] for s in steps
                                      if start <= s[0] - s[1] and s[0] <= end])
                   for _, start, end in windows]
        rounds = [(medians[i] / medians[i + 1]) if windows[i][0] else
                  (medians[i + 1] / medians[i]) for i in range(0, len(windows), 2)]
        out.append((statistics.median(rounds), min(rounds), max(rounds)))
    return out[0], out[1], len(steps)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="diag-bench-attach-") as tmp:
        load = os.getloadavg()[0]
        errors = attach_errors(Path(tmp))
        traced = trace_errors(Path(tmp))
        cpu, wall, n = overhead()
        print(f"load average {load:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        for name, err in errors.items():
            print(f"  attach, {name}: worst share gap {err:.3f}")
        for name, err in traced.items():
            print(f"  trace, {name}: worst share gap {err:.3f}")
        print(f"  overhead over {n} steps, {ROUNDS} rounds of {WINDOW_S:g} s windows: CPU "
              f"{cpu[0]:.4f} (rounds {cpu[1]:.3f} to {cpu[2]:.3f}), wall {wall[0]:.4f} "
              f"(rounds {wall[1]:.3f} to {wall[2]:.3f})")
        print(f"attach_share_error = {max(errors.values()):.3f} (goal <= 0.05)")
        print(f"attach_overhead = {cpu[0]:.4f} (goal <= 1.02, CPU seconds per step)")
        print(f"trace_share_error = {max(traced.values()):.3f} (goal <= 0.05)")


if __name__ == "__main__":
    main()
