"""What does timing a loop cost? A ~1 ms step split into four timed stages vs the same loop untimed.

Both loops run side by side in this process, alternating in rounds so machine noise hits both;
the ratio is the median over rounds of timed/untimed wall time. Last line:
`timer_overhead: <ratio> (goal <= 1.01)`.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

# One BLAS thread: a multi-threaded matmul on a shared 2-core box is mostly scheduler noise.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.timing import StageTimer  # noqa: E402

STEPS = 50  # steps per loop per round
ROUNDS = 61  # alternating timed/untimed rounds (order flipped each round); median ratio reported
STAGES = ("data_wait", "h2d", "compute", "other")


def calibrate(target_s: float = 0.00025) -> int:
    """Matrix side whose matmul takes ~target_s, so four of them make a ~1 ms step."""
    n = 32
    while True:
        a = np.ones((n, n), dtype=np.float32)
        start = time.perf_counter()
        for _ in range(20):
            a @ a
        if (time.perf_counter() - start) / 20 >= target_s or n >= 2048:
            return n
        n = int(n * 1.25) + 1


def untimed(a: np.ndarray) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        for _ in STAGES:
            a @ a
    return time.perf_counter() - start


def timed(a: np.ndarray, timer: StageTimer) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        for name in STAGES:
            with timer.stage(name):
                a @ a
    return time.perf_counter() - start


def main() -> None:
    n = calibrate()
    a = np.ones((n, n), dtype=np.float32)
    untimed(a), timed(a, StageTimer())  # burn in: caches, BLAS threads
    ratios, step_ms = [], []
    for i in range(ROUNDS):
        timer = StageTimer()
        if i % 2:
            base = untimed(a)
            with_timer = timed(a, timer)
        else:
            with_timer = timed(a, timer)
            base = untimed(a)
        ratios.append(with_timer / base)
        step_ms.append(base / STEPS * 1000)
        assert len(timer.to_frame()) == STEPS * len(STAGES)
    disabled = StageTimer(enabled=False)
    off = statistics.median(timed(a, disabled) / untimed(a) for _ in range(5))
    print(f"matrix {n}x{n}, step {statistics.median(step_ms):.2f} ms, {len(STAGES)} stages, "
          f"{ROUNDS} rounds x {STEPS} steps")
    print(f"disabled timer ratio: {off:.4f}")
    print(f"timer_overhead: {statistics.median(ratios):.4f} (goal <= 1.01)")


if __name__ == "__main__":
    main()
