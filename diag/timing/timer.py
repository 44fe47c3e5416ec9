"""StageTimer: where the wall clock of a training run goes, in the stage vocabulary.

`with timer.stage("compute"):` (or `@timer.stage("compute")`) records one interval;
`for batch in timer.watch(loader):` records the time the loop is blocked on each `next()` as
`data_wait` and numbers the steps. `to_frame()` gives one row per interval: `stage`, `seconds`,
`step` (<NA> for run-level stages), `rank`, `node`; under DDP `timer.watch_comm(ddp_model)` splits
each `compute` into compute and `comm_wait` (its waits on the other ranks), and `gather(dst=0)`
collects every rank once at the end. Read it with `diag.amdahl`; a disabled timer
(`StageTimer(enabled=False)`) keeps the loop's code identical and costs almost nothing. Each stage
is also a named range in the traces users already read: a torch.profiler range while a profiler
records (Perfetto, HTA) and, on CUDA, an NVTX range (Nsight); `trace=False` turns both off.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ContextDecorator
from typing import Any

from diag.timing.comm import CommWait
from diag.timing.distributed import gather_to_root, place
from diag.timing.spill import Spill

# Run-level stages happen once per training run; step-level stages once per optimizer step.
RUN_STAGES = ("fetch_data", "load_model", "preprocess", "setup", "warmup", "train", "checkpoint",
              "eval")
# comm_wait: under DDP, the time a rank waits on the others in a collective (diag.timing.comm).
STEP_STAGES = ("data_wait", "h2d", "compute", "comm_wait", "other")
# The parts of load_model, reported beside it (they add up to it, they are not extra time).
# `import` (interpreter start + torch/transformers/bitsandbytes) is in it: every job start pays it.
LOAD_PARTS = ("import", "download", "read", "quantize", "to_device", "tokenizer")
STAGES = RUN_STAGES + STEP_STAGES + LOAD_PARTS


def check_stage(name: str) -> str:
    if name not in STAGES:
        raise ValueError(
            f"unknown stage {name!r}: allowed stages are run-level {', '.join(RUN_STAGES)}; "
            f"step-level {', '.join(STEP_STAGES)}; load_model parts {', '.join(LOAD_PARTS)}"
        )
    return name


class _Stage(ContextDecorator):
    """One named interval; reusable, so `timer.stage("x")` can decorate a function."""

    __slots__ = ("_timer", "_name", "_start", "_range")

    def __init__(self, timer: StageTimer, name: str) -> None:
        self._timer = timer
        self._name = name
        self._start = 0.0
        self._range: Any = None

    def _recreate_cm(self) -> _Stage:
        # A fresh interval per decorated call, so recursion and threads do not share a start.
        return _Stage(self._timer, self._name)

    def __enter__(self) -> _Stage:
        timer = self._timer
        if timer._sync is not None:
            timer._sync()  # note: CPU-GPU sync point, so the previous
                           # stage's kernels are not billed here
        if timer.trace:  # opened before the clock starts: its cost is not billed to the stage
            self._range = timer._open_range(self._name)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> bool:
        timer = self._timer
        if timer._sync is not None:
            timer._sync()  # note: CPU-GPU sync point, so this
                           # stage's queued kernels are billed to it
        # Recorded even when the body raised: a failed stage still spent the time.
        seconds, step = time.perf_counter() - self._start, timer._step_for(self._name)
        if timer.comm is not None and self._name == "compute":
            # the waits on other ranks inside forward and backward are not compute: billed
            # apart, summing to it
            wait = min(timer.comm.take(), seconds)
            timer._rows.append(("comm_wait", wait, step))
            seconds -= wait
        timer._rows.append((self._name, seconds, step))
        if timer.trace:
            timer._close_range(self._range)
        return False


class _NullStage(ContextDecorator):
    __slots__ = ()

    def __enter__(self) -> _NullStage:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


_NULL_STAGE = _NullStage()


class StageTimer:
    """Accumulates (stage, seconds, step) intervals for one process (one rank).

    device: "cuda"/torch.device makes every stage boundary a device sync, so asynchronous
    kernels are billed to the stage that queued them; on CPU no sync is needed or done.
    trace: also mark each stage as a torch.profiler range (only while a profiler records, so
    it costs a flag check otherwise) and, on CUDA, an NVTX range.
    """

    def __init__(self, enabled: bool = True, device: Any = None, rank: int | None = None,
                 trace: bool = True) -> None:
        self.enabled = enabled
        self.trace = enabled and trace
        self._nvtx: Any = None
        seat = place()  # the launcher's environment, or the process group when it is up
        self.rank = seat.rank if rank is None else rank
        self.node = seat.node
        self.local_rank, self.world_size = seat.local_rank, seat.world_size
        self.comm: CommWait | None = None  # set by watch_comm under DDP
        self._spill: Spill | None = None  # where finished steps' rows go (spill_to)
        self._spilled = 0
        self.step: int | None = None  # set by watch(); step-level stages are tagged with it
        self._rows: list[tuple[str, float, int | None]] = []
        self._sync: Callable[[], None] | None = None
        if enabled and device is not None:
            from diag.machine import device as devices

            if devices.is_async(device):
                self._sync = lambda: devices.sync(device)
                if self.trace:
                    import torch

                    self._nvtx = torch.cuda.nvtx  # Nsight attaches from outside: always push

    def _open_range(self, name: str) -> Any:
        """Open the trace ranges of one stage; returns what _close_range needs."""
        torch = sys.modules.get("torch")  # no torch in this process: no profiler to show it
        if torch is None:
            return None
        if self._nvtx is not None:
            self._nvtx.range_push(name)
        if not torch.autograd._profiler_enabled():  # record_function costs ~20 us even unseen
            return None
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        return rf

    def _close_range(self, rf: Any) -> None:
        if rf is not None:
            rf.__exit__(None, None, None)
        if self._nvtx is not None:
            self._nvtx.range_pop()

    def stage(self, name: str) -> _Stage | _NullStage:
        """Context manager and decorator timing one stage of the vocabulary."""
        if not self.enabled:
            return _NULL_STAGE
        return _Stage(self, check_stage(name))

    def record(self, name: str, seconds: float, step: int | None = None) -> None:
        """Add an interval measured elsewhere (e.g. a worker process, a subprocess)."""
        if not self.enabled:
            return
        if seconds < 0:
            raise ValueError(f"seconds={seconds!r} for stage {name!r}: durations must be >= 0")
        check_stage(name)
        self._rows.append((name, float(seconds),
                           step if step is not None else self._step_for(name)))

    def watch_comm(self, ddp_model: Any, hook: Any = None, state: Any = None) -> None:
        """Measure comm_wait on ddp_model (before its first forward): its buffer broadcast and
        its gradient all-reduce, through a communication hook that wraps DDP's own reduction, or
        `hook` with `state` (yours: fp16 compression, PowerSGD; registered here, not by you).
        Every `compute` stage after this is split into compute + comm_wait."""
        if self.enabled:
            self.comm = CommWait(ddp_model, hook, state)

    def spill_to(self, path: Any) -> None:
        """Append the rows to path (diag.timing.spill) at each `flush()`, so a killed process
        leaves the frames of the steps it finished."""
        if self.enabled:
            self._spill = Spill(path, self.rank, self.node)

    def flush(self) -> None:
        """Write the rows recorded since the last flush to the spill file (one write, no sync
        with any other rank); a no-op without spill_to."""
        if self._spill is None:
            return
        new = self._rows[self._spilled:]
        self._spilled += len(new)
        self._spill.write(new)

    @property
    def spill_path(self) -> Any:  # -> pathlib.Path | None
        return self._spill.path if self._spill is not None else None

    def close_spill(self, remove: bool = True) -> None:
        """Stop spilling; remove the file once the complete frame is safe elsewhere."""
        if self._spill is not None:
            self._spill.close(remove)
            self._spill = None

    def watch(self, iterable: Iterable[Any], start_step: int = 0) -> Iterator[Any]:
        """Yield the same items; the time blocked in each `next()` is that step's data_wait."""
        if not self.enabled:
            yield from iterable
            return
        iterator = iter(iterable)
        step = start_step
        try:
            while True:
                self.step = step
                span = self._open_range("data_wait") if self.trace else None
                start = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    seconds = time.perf_counter() - start
                    if self.trace:
                        self._close_range(span)
                self._rows.append(("data_wait", seconds, step))
                yield item
                step += 1
        finally:
            self.step = None  # a stage timed after the loop belongs to no step

    def _step_for(self, name: str) -> int | None:
        return self.step if name in STEP_STAGES else None

    def total(self, name: str) -> float:
        return sum(seconds for stage, seconds, _ in self._rows if stage == name)

    def to_frame(self):  # -> pandas.DataFrame
        """One row per interval: stage, seconds, step (<NA> for run-level), rank, node."""
        import pandas as pd

        frame = pd.DataFrame(self._rows, columns=["stage", "seconds", "step"])
        frame["step"] = frame["step"].astype("Int64")
        frame["rank"] = self.rank
        frame["node"] = self.node
        return frame

    def gather(self, dst: int | None = None):  # -> pandas.DataFrame | None
        """All ranks' frames in one (torch.distributed, any backend); own frame if alone.

        dst=None: on every rank (all_gather); dst=0: on rank 0 only, None on the others. Call
        it once at the end of a run: it is a collective every rank must reach."""
        import pandas as pd
        import torch.distributed as dist

        frame = self.to_frame()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return frame
        if dst is not None:
            assert dst == 0, "frames gather on rank 0, the rank that writes the run folder"
            frames = gather_to_root(frame)
            return None if frames is None else pd.concat(frames, ignore_index=True)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, frame)
        return pd.concat(everyone, ignore_index=True)


STAGE_FRAME = "run"  # the key a StageTimer frame (with a `run` column) is stored under, always
STAGE_COLUMNS = ("stage", "seconds", "step")  # what StageTimer.to_frame() gives


def is_stage_frame(frame: Any) -> bool:
    """A StageTimer frame (diag.loader.toy, diag.qlora's stages, diag run's runs)?"""
    return set(STAGE_COLUMNS) <= set(getattr(frame, "columns", ()))


def median_seconds(frame: Any, **where: Any) -> float | None:
    """Median `seconds` of the rows where each column equals its value (e.g. method="land",
    cache_state="hit"); None when there is no frame, no such column or no such row."""
    if frame is None or getattr(frame, "empty", True):
        return None
    for column, value in where.items():
        if column not in frame.columns:
            return None
        frame = frame[frame[column] == value]
    return float(frame["seconds"].median()) if not frame.empty else None
