"""StageTimer: where the wall clock of a training run goes, in the stage vocabulary.

`with timer.stage("compute"):` times one interval, `timer.watch(loader)` each batch's wait as
`data_wait`; `to_frame()` is what `diag.amdahl` reads. Each stage is also a profiler / NVTX range.
Under DDP `CommWait(ddp)` clocks `comm_wait`, the waits on late ranks inside a step (DDP's buffer
broadcast, the gradient all-reduce); `ddp_exposed_s(ddp)` is DDP's own all-reduce figure."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ContextDecorator
from typing import TYPE_CHECKING, Any

from pathlib import Path

from diag.timing.distributed import ROOT, SPILL_COLUMNS, _dist, gather, place

if TYPE_CHECKING:
    import pandas as pd

# once per training run; once per optimizer step (comm_wait: waiting on other ranks under DDP)
RUN_STAGES = ("fetch_data", "load_model", "preprocess", "setup", "warmup", "train", "checkpoint",
              "eval")
STEP_STAGES = ("data_wait", "h2d", "compute", "comm_wait", "other")
# load_model's parts, reported beside it (they add up to it); every job start pays `import`
LOAD_PARTS = ("import", "download", "read", "quantize", "to_device", "tokenizer")
STAGES = RUN_STAGES + STEP_STAGES + LOAD_PARTS
STAGE_FRAME = "run"  # the key a StageTimer frame (with a `run` column) is stored under
log = logging.getLogger("diag")


def check_stage(name: str) -> str:
    if name not in STAGES:
        raise ValueError(
            f"unknown stage {name!r}: allowed stages are run-level {', '.join(RUN_STAGES)}; "
            f"step-level {', '.join(STEP_STAGES)}; load_model parts {', '.join(LOAD_PARTS)}")
    return name


class _Stage(ContextDecorator):
    """One named interval (nothing when the timer is off); reusable as a decorator."""

    __slots__ = ("_timer", "_name", "_start", "_range")

    def __init__(self, timer: StageTimer, name: str) -> None:
        self._timer, self._name, self._start, self._range = timer, name, 0.0, None

    def _recreate_cm(self) -> _Stage:  # per decorated call: recursion and threads own a start
        return _Stage(self._timer, self._name)

    def __enter__(self) -> _Stage:
        timer = self._timer
        if not timer.enabled:
            return self
        if timer._sync is not None:
            timer._sync()  # note: CPU-GPU sync point: the previous stage's kernels are not ours
        if timer.trace:  # opened before the clock starts: not billed to the stage
            self._range = timer._open_range(self._name)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> bool:
        timer = self._timer
        if not timer.enabled:
            return False
        if timer._sync is not None:
            timer._sync()  # note: CPU-GPU sync point: this stage's queued kernels are billed to it
        # recorded even when the body raised: a failed stage still spent the time
        seconds, step = time.perf_counter() - self._start, timer._step_for(self._name)
        if timer.comm is not None and self._name == "compute":
            # waits on other ranks inside forward and backward are comm_wait, not compute
            wait = min(timer.comm.take(), seconds)
            timer._rows.append(("comm_wait", wait, step))
            seconds -= wait
        timer._rows.append((self._name, seconds, step))
        timer._close_range(self._range)
        return False


class StageTimer:
    """(stage, seconds, step) intervals of one rank; device: CUDA syncs, trace: profiler ranges."""

    def __init__(self, enabled: bool = True, device: Any = None, rank: int | None = None,
                 trace: bool = True) -> None:
        seat = place()
        self.enabled, self.trace, self._nvtx = enabled, enabled and trace, None
        self.rank = seat.rank if rank is None else rank
        self.node, self.local_rank, self.world_size = seat.node, seat.local_rank, seat.world_size
        self.comm: CommWait | None = None  # set by watch_comm under DDP
        self._spill: Any = None  # the open spill file (spill_to)
        self.spill_path: Path | None = None
        self._spilled = 0  # rows written to the spill
        self.step: int | None = None  # set by watch(): tags step-level stages
        self._rows: list[tuple[str, float, int | None]] = []
        self._sync: Callable[[], None] | None = None
        if enabled and device is not None:
            from diag.machine import device as devices

            if devices.is_async(device):
                self._sync = lambda: devices.sync(device)
                if self.trace:  # Nsight attaches from outside: always push
                    self._nvtx = sys.modules["torch"].cuda.nvtx

    def _open_range(self, name: str) -> Any:
        torch = sys.modules.get("torch")  # no torch imported: no profiler to show it
        if torch is None:
            return None
        if self._nvtx is not None:
            self._nvtx.range_push(name)
        if not torch.autograd._profiler_enabled():  # record_function costs even unseen
            return None
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        return rf

    def _close_range(self, rf: Any) -> None:  # a no-op without trace: no range, no NVTX
        if rf is not None:
            rf.__exit__(None, None, None)
        if self._nvtx is not None:
            self._nvtx.range_pop()

    def stage(self, name: str) -> _Stage:
        """Context manager and decorator timing one stage."""
        return _Stage(self, check_stage(name) if self.enabled else name)

    def record(self, name: str, seconds: float, step: int | None = None) -> None:
        """Add an interval measured elsewhere (a worker, a subprocess)."""
        if not self.enabled:
            return
        if seconds < 0:
            raise ValueError(f"seconds={seconds!r} for stage {name!r}: durations must be >= 0")
        self._rows.append((check_stage(name), float(seconds),
                           self._step_for(name) if step is None else step))

    def watch_comm(self, ddp_model: Any, hook: Any = None, state: Any = None) -> None:
        """Split each later `compute` into compute + comm_wait, before ddp_model's first forward."""
        if self.enabled:
            self.comm = CommWait(ddp_model, hook, state)

    def spill_to(self, path: Any) -> None:
        """Append the rows to path at each `flush()`: a killed process leaves its finished steps."""
        if self.enabled:
            self.spill_path = Path(path)
            self._spill = open(path, "a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
            self._spill.write(",".join(SPILL_COLUMNS) + "\n")
            self._spill.flush()

    def flush(self) -> None:
        """Write the rows since the last flush to the spill, whole CSV lines in one write."""
        if self._spill is not None:
            rows = self._rows[self._spilled:]
            self._spill.write("".join(f"{s},{sec!r},{'' if st is None else st},{self.rank},"
                                      f"{self.node}\n" for s, sec, st in rows))
            self._spill.flush()
            self._spilled = len(self._rows)

    def close_spill(self) -> None:
        """Stop spilling and remove the file: the whole frame is safe elsewhere."""
        if self._spill is not None:
            self._spill.close()
            os.unlink(self.spill_path)
            self._spill = self.spill_path = None

    def step_done(self, step: int, data_wait: float, busy: float, waited: float = 0.0) -> None:
        """A step's data_wait, then `busy` as comm_wait (waited + the waits inside) and compute."""
        inside = min(self.comm.take(), busy) if self.comm is not None else None
        self.record("data_wait", data_wait, step=step)
        if inside is not None:
            self.record("comm_wait", waited + inside, step=step)
        self.record("compute", max(busy - (inside or 0.0), 0.0), step=step)

    def watch(self, iterable: Iterable[Any], start_step: int = 0) -> Iterator[Any]:
        """Yield the same items; the time blocked in each `next()` is that step's data_wait."""
        if not self.enabled:
            yield from iterable
            return
        iterator, step = iter(iterable), start_step
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
                    self._close_range(span)
                self._rows.append(("data_wait", seconds, step))
                yield item
                step += 1
        finally:
            self.step = None

    def _step_for(self, name: str) -> int | None:
        return self.step if name in STEP_STAGES else None

    def total(self, name: str) -> float:
        return sum(seconds for stage, seconds, _ in self._rows if stage == name)

    def to_frame(self) -> pd.DataFrame:
        """One row per interval: stage, seconds, step (<NA>: run-level), rank, node."""
        import pandas as pd

        frame = pd.DataFrame(self._rows, columns=["stage", "seconds", "step"])
        return frame.astype({"step": "Int64"}).assign(rank=self.rank, node=self.node)

    def gather(self, dst: int | None = None) -> pd.DataFrame:
        """Every rank's frame on every rank (dst=None) or rank 0 (dst=0; its own elsewhere)."""
        import pandas as pd

        assert dst in (None, ROOT), "frames gather on rank 0, the rank that writes the run folder"
        frame = self.to_frame()
        every = gather(frame, dst)
        return frame if every is None else pd.concat(every, ignore_index=True)


def is_stage_frame(frame: Any) -> bool:
    return {"stage", "seconds", "step"} <= set(getattr(frame, "columns", ()))


def median_seconds(frame: Any, **where: Any) -> float | None:
    """Median `seconds` of the rows matching every column=value; None: no frame, column or row."""
    if frame is None or getattr(frame, "empty", True):
        return None
    for column, value in where.items():
        if column not in frame.columns:
            return None
        frame = frame[frame[column] == value]
    return float(frame["seconds"].median()) if not frame.empty else None


class CommWait:
    """Per step (`take()`), the buffer broadcast and all-reduce waits (a comm hook wrapping DDP's
    average or your `hook`; a hook registered before stays in compute, said once)."""

    def __init__(self, ddp: Any, hook: Any = None, state: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self._ddp, self._started = ddp, None
        # (start, end, an all-reduce?) of each wait since take(): a broadcast, or backward's
        # compute ended to DDP having every bucket's all-reduce back
        self._spans: list[tuple[Any, Any, bool]] = []
        self._events = torch.cuda.Event if next(ddp.parameters()).is_cuda else None
        self.all_reduce_s: list[float] = []  # the first 10 backwards' (as DDP's logging)
        if ddp.will_sync_module_buffers():
            ddp.register_forward_pre_hook(self._before_broadcast)
            ddp.module.register_forward_pre_hook(self._after_broadcast)
        present = ddp._get_ddp_logging_data().get("comm_hook")
        if present:
            if place().is_root:
                log.warning(f"diag: DDP already has a communication hook ({present}), which diag "
                            "cannot wrap once registered: comm_wait leaves out the gradient "
                            "all-reduce (it stays in compute); to time it, give the hook to "
                            "diag instead (StageTimer.watch_comm(ddp, hook=..., state=...))")
            return
        inner = hook if hook is not None else self._average
        state = state if hook is not None else ddp.process_group

        def timed(state: Any, bucket: Any) -> Any:
            if bucket.is_last():  # queued before DDP's finalize, which waits for the buckets
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            return inner(state, bucket)

        # DDP checks the hook's annotations, which `from __future__ import annotations` made text
        timed.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}
        timed.__qualname__ = f"diag_timed({getattr(inner, '__qualname__', 'hook')})"
        ddp.register_comm_hook(state, timed)

    @staticmethod
    def _average(group: Any, bucket: Any) -> Any:
        """DDP's own average, called as its reducer calls it (dist.all_reduce's checks cost)."""
        buffer = bucket.buffer()
        buffer.mul_(1.0 / group.size())
        return group.allreduce([buffer]).get_future().then(lambda fut: fut.value()[0])

    def _backward_end(self) -> None:
        from torch.autograd import Variable

        ended = self._stamp()  # the callback runs after DDP's finalize: every bucket is back
        Variable._execution_engine.queue_callback(
            lambda: self._spans.append((ended, self._stamp(), True)))

    def _before_broadcast(self, module: Any, args: Any) -> None:
        self._started = self._stamp() if self._ddp.will_sync_module_buffers() else None

    def _after_broadcast(self, module: Any, args: Any) -> None:
        if self._started is not None:
            self._spans.append((self._started, self._stamp(), False))
            self._started = None

    def _stamp(self) -> Any:
        if self._events is None:
            return time.perf_counter()
        event = self._events(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start: Any, end: Any) -> float:
        if self._events is None:
            return max(end - start, 0.0)
        end.synchronize()  # recorded before the timer's step-boundary sync: already done
        return max(start.elapsed_time(end) / 1000.0, 0.0)

    def take(self) -> float:
        """Seconds waited on the other ranks since the last take (0.0 when nothing ran)."""
        spans, self._spans, total = self._spans, [], 0.0
        for start, end, reduce in spans:
            seconds = self._seconds(start, end)
            if reduce and len(self.all_reduce_s) < 10:
                self.all_reduce_s.append(seconds)
            total += seconds
        return total


def ddp_exposed_s(ddp: Any) -> float | None:
    """DDP's own mean exposed all-reduce (comm minus its overlap with backward), None before any."""
    data = ddp._get_ddp_logging_data()
    comm = data.get("avg_backward_comm_time")
    return max(comm - data.get("avg_backward_compute_comm_overlap_time", 0), 0) / 1e9 \
        if comm else None


def find_ddp(*candidates: Any) -> Any:
    """The first DistributedDataParallel among candidates (a Trainer's model_wrapped), or None."""
    if _dist() is None:
        return None
    from torch.nn.parallel import DistributedDataParallel

    return next((m for m in candidates if isinstance(m, DistributedDataParallel)), None)
