"""`comm_wait`: the time a DDP rank spends waiting on the others inside its step.

A late rank makes the others wait at the first collective after its delay: DDP's buffer broadcast
at the start of forward, or the gradient all-reduce after backward. `CommWait(ddp)` clocks both;
`ddp_exposed_s(ddp)` is DDP's own figure for the exposed all-reduce (bench/distributed.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from diag.timing.distributed import _dist, place

log = logging.getLogger("diag")


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
