"""`comm_wait`: the part of the gradient all-reduce that backward does not hide, measured by a DDP
communication hook, so a rank that arrives late shows up as the others' wait."""

from __future__ import annotations

import time
from typing import Any

from diag.timing.distributed import _dist


class CommWait:
    """A DDP communication hook that all-reduces (averages) each gradient bucket like DDP's
    default and clocks the wait backward leaves exposed.

    Per step that wait is the last bucket's all-reduce end minus the moment the last bucket was
    handed over (backward's end): the all-reduces that finished while backward still ran cost
    nothing. On CPU (gloo) both are host clocks; on CUDA they are events on the streams, read
    at the next `take()` (after the timer's sync point), so nothing here syncs inside a step.
    """

    def __init__(self, model: Any) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        self._cuda = next(model.parameters()).is_cuda
        self._events = torch.cuda.Event if self._cuda else None
        self._reset()

        def hook(state: Any, bucket: Any) -> Any:
            return self._hook(state, bucket)

        # DDP checks the hook's annotations, which `from __future__ import annotations` made text
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        model.register_comm_hook(None, hook)

    def _reset(self) -> None:
        self._handed: Any = None  # time (or event) the last bucket was handed to all-reduce
        self._done: Any = None  # time (or event) the last all-reduce finished

    def _stamp(self) -> Any:
        if self._events is None:
            return time.perf_counter()
        event = self._events(enable_timing=True)
        event.record()
        return event

    def _hook(self, state: Any, bucket: Any) -> Any:
        buffer = bucket.buffer()
        buffer.div_(self._dist.get_world_size())
        self._handed = self._stamp()
        work = self._dist.all_reduce(buffer, async_op=True)

        def finished(fut: Any) -> Any:
            # runs when the all-reduce completes (gloo: its thread; CUDA: on a stream that
            # waits for it), so its stamp is the end of this bucket's communication
            stamp = self._stamp()
            if self._events is not None or self._done is None or stamp > self._done:
                self._done = stamp
            return fut.value()[0]

        return work.get_future().then(finished)

    def take(self) -> float:
        """Seconds of exposed all-reduce wait since the last take (0.0 when none ran)."""
        handed, done = self._handed, self._done
        self._reset()
        if handed is None or done is None:
            return 0.0
        if self._events is not None:
            done.synchronize()
            return max(handed.elapsed_time(done) / 1000.0, 0.0)
        return max(done - handed, 0.0)


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
