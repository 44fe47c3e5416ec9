"""`TimedStep(step, ddp)`: diag.accum's harness step (a micro-batch at a time), each optimizer
step billed as the Trainer's callback does: `data_wait`, `comm_wait`, `compute` (the rest).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pandas as pd

from diag.machine.device import sync
from diag.timing.distributed import gather, gathered_frame, place
from diag.timing.timer import StageTimer

POINT = ["micro_batch", "grad_accum", "repeat"]  # names a harness row's step


class TimedStep:
    """The harness's step timed per optimizer step; its model, optimizer, no_sync are the step's."""

    def __init__(self, step: Any, ddp: Any, timer: StageTimer | None = None) -> None:
        self._step, self.device = step, step.device
        self.timer = timer if timer is not None else StageTimer(device=step.device)
        self.timer.watch_comm(ddp)  # before its first forward
        self.points: list[tuple[int, int]] = []  # per optimizer step: (micro_batch, grad_accum)
        self._micro = 0
        self._open()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def _open(self) -> None:
        self._start: float | None = None  # the step's first batch request
        self._data, self._micro_steps = 0.0, 0  # seconds blocked on its batches

    @contextlib.contextmanager
    def batches(self, micro_batch: int) -> Iterator[Iterator[Any]]:
        self._micro = micro_batch
        with self._step.batches(micro_batch) as batches:
            yield self._arrivals(iter(batches))

    def _arrivals(self, iterator: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            self._start = start if self._start is None else self._start
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._data += time.perf_counter() - start
            yield batch

    def reset(self) -> None:
        self._step.reset()
        if self.timer.comm is not None:
            self.timer.comm.take()  # a wait outside a step is no step's
        self._open()

    def backward(self, batch: Any, scale: float) -> None:
        self._micro_steps += 1
        self._step.backward(batch, scale)

    def update(self) -> None:
        self._step.update()
        sync(self.device)  # note: sync point: the step's queued kernels are billed to it
        end = time.perf_counter()
        seconds = end - (self._start if self._start is not None else end)
        self.timer.step_done(len(self.points), self._data, max(seconds - self._data, 0.0))
        self.timer.flush()  # under a launcher: the finished step survives a kill
        self.points.append((self._micro, self._micro_steps))
        self._open()

    def gathered(self, rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
        """A collective: (every rank's rows, comm_wait_s out of compute_s; stage rows) on rank 0."""
        seat, stages = place(), gathered_frame(self.timer)
        mine = rows.assign(rank=seat.rank, node=seat.node)
        every = pd.concat(gather(mine) or [mine], ignore_index=True)
        timed = []  # the step of each timed row: a point's last steps (those before: its warm-up)
        for (micro, accum), part in rows[rows["status"] == "ok"].groupby(
                ["micro_batch", "grad_accum"], sort=False):
            steps = [i for i, p in enumerate(self.points) if p == (micro, accum)]
            repeats = sorted(part["repeat"])
            timed += [{"step": step, "micro_batch": micro, "grad_accum": accum, "repeat": repeat}
                      for step, repeat in zip(steps[len(steps) - len(repeats):], repeats)]
        stages = stages.merge(pd.DataFrame(timed, columns=["step", *POINT]).astype(
            {"step": "Int64"}), on="step")  # the warm-up steps go
        waits = stages.loc[stages["stage"] == "comm_wait", ["rank", *POINT, "seconds"]]
        every = every.merge(waits.rename(columns={"seconds": "comm_wait_s"}), how="left",
                            on=["rank", *POINT])  # an "oom" row ran no step: NaN
        every["compute_s"] -= every["comm_wait_s"]
        stages["run"] = [f"{m} x {a}" for m, a in zip(stages["micro_batch"], stages["grad_accum"])]
        return ranks_first(every), stages.drop(columns=POINT)


def ranks_first(rows: pd.DataFrame) -> pd.DataFrame:
    """Harness rows with rank and node first, comm_wait_s beside data_s (alone: 0, 0, 0.0)."""
    if "rank" not in rows.columns:
        rows = rows.assign(rank=0, node=0, comm_wait_s=0.0)
    rest = [c for c in rows.columns if c not in ("rank", "node", "comm_wait_s")]
    at = rest.index("data_s") + 1
    return rows[["rank", "node", *rest[:at], "comm_wait_s", *rest[at:]]].copy()
