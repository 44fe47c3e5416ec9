"""`comm_wait`: the time a DDP rank spends waiting on the others inside its step.

A late rank makes the others wait at the first collective after its delay, wherever that falls:
DDP's buffer broadcast at the start of forward (a model with buffers: Llama's rotary
frequencies, BatchNorm's statistics) or the gradient all-reduce at the end of backward (the
Trainer's token-count gather is timed by diag.timing.callback). `CommWait(ddp)` clocks both,
the broadcast between two forward pre-hooks and the all-reduce through a communication hook
that wraps DDP's own reduction, or the user's hook, and only times it. `ddp_exposed_s(ddp)` is
DDP's own figure for the exposed all-reduce, to check diag's against.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from diag.timing.distributed import _dist, place

log = logging.getLogger("diag")


class CommWait:
    """Clocks the waits on the other ranks inside a DDP step; `take()` returns them per step.

    Broadcast: from DDP's forward pre-hook (before it syncs buffers) to its module's (after),
    counted only when DDP syncs buffers. All-reduce: the last bucket's all-reduce end minus the
    moment the last bucket was handed over (backward's end); the all-reduces that finished
    while backward still ran cost nothing. On CPU (gloo) these are host clocks; on CUDA they are
    events on the streams, read at `take()` after the timer's step-boundary sync, so nothing
    here syncs inside a step. hook, state: a communication hook of the user's (fp16
    compression, PowerSGD), registered through diag so it is wrapped; without one, DDP's own
    average over the process group DDP was given. A hook already registered cannot be wrapped:
    one line says so, and the all-reduce's wait stays in compute.
    """

    def __init__(self, ddp: Any, hook: Any = None, state: Any = None) -> None:
        import torch

        self._ddp = ddp
        self._events = torch.cuda.Event if next(ddp.parameters()).is_cuda else None
        self._spans: list[tuple[Any, Any]] = []  # (start, end) of each broadcast since take()
        self._started: Any = None
        self.all_reduce_s: list[float] = []  # the first backwards' exposed waits: the ones
                                             # DDP's logging data samples (ddp_exposed_s)
        self._handed: Any = None  # time (or event) the last bucket was handed to all-reduce
        self._done: Any = None  # time (or event) the last all-reduce finished
        if ddp.will_sync_module_buffers():
            ddp.register_forward_pre_hook(self._before_broadcast)
            ddp.module.register_forward_pre_hook(self._after_broadcast)
        self.wraps = self._register(hook, state)

    def _register(self, hook: Any, state: Any) -> str:
        """Register the timed hook; returns what it wraps ("" when it cannot)."""
        import torch
        import torch.distributed as dist

        present = self._ddp._get_ddp_logging_data().get("comm_hook")
        if present:
            if place().is_root:
                log.warning(f"diag: DDP already has a communication hook ({present}), which diag "
                            "cannot wrap once registered: comm_wait leaves out the gradient "
                            "all-reduce (it stays in compute); to time it, give the hook to "
                            "diag instead (StageTimer.watch_comm(ddp, hook=..., state=...))")
            return ""
        inner = hook if hook is not None else self._average
        state = state if hook is not None else self._ddp.process_group

        def timed(state: Any, bucket: Any) -> Any:
            self._handed = self._stamp()
            return inner(state, bucket).then(self._finished)

        # DDP checks the hook's annotations, which `from __future__ import annotations` made text
        timed.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}
        timed.__qualname__ = f"diag_timed({getattr(inner, '__qualname__', 'hook')})"
        self._ddp.register_comm_hook(state, timed)
        return getattr(inner, "__qualname__", repr(inner))

    @staticmethod
    def _average(group: Any, bucket: Any) -> Any:
        """DDP's built-in reduction: each gradient times 1/size (the factor DDP multiplies by
        while copying into the bucket, reducer.cpp), summed over DDP's own process group."""
        buffer = bucket.buffer()
        buffer.mul_(1.0 / group.size())
        # the group's own all-reduce (a sum), as DDP's reducer calls it: dist.all_reduce's
        # Python checks cost ~70 us a call (gloo, 2-core box), 0.8% of a 9 ms step
        return group.allreduce([buffer]).get_future()

    def _finished(self, fut: Any) -> Any:
        # runs when the all-reduce completes (gloo: its thread; CUDA: on a stream that waits for
        # it), so its stamp is the end of this bucket's communication
        stamp = self._stamp()
        if self._events is not None or self._done is None or stamp > self._done:
            self._done = stamp
        value = fut.value()
        return value[0] if isinstance(value, list) else value  # all_reduce's future: [tensor]

    def _before_broadcast(self, module: Any, args: Any) -> None:
        self._started = self._stamp() if self._ddp.will_sync_module_buffers() else None

    def _after_broadcast(self, module: Any, args: Any) -> None:
        if self._started is not None:
            self._spans.append((self._started, self._stamp()))
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
        spans, handed, done = self._spans, self._handed, self._done
        self._spans, self._handed, self._done = [], None, None
        seconds = sum(self._seconds(start, end) for start, end in spans)
        if handed is not None and done is not None:
            exposed = self._seconds(handed, done)
            if len(self.all_reduce_s) < 10:
                self.all_reduce_s.append(exposed)
            seconds += exposed
        return seconds


def ddp_exposed_s(ddp: Any) -> float | None:
    """DDP's own mean exposed all-reduce per sampled iteration (its logging data: backward comm
    minus the part overlapped with backward compute), None before any; DDP samples the first
    10 iterations, then one in 100."""
    data = ddp._get_ddp_logging_data()
    comm = data.get("avg_backward_comm_time")
    if not comm:
        return None
    return max(comm - data.get("avg_backward_compute_comm_overlap_time", 0), 0) / 1e9


def find_ddp(*candidates: Any) -> Any:
    """The first DistributedDataParallel among candidates (a Trainer's model_wrapped), or None."""
    dist = _dist()
    if dist is None:
        return None
    from torch.nn.parallel import DistributedDataParallel

    for model in candidates:
        if isinstance(model, DistributedDataParallel):
            return model
    return None
