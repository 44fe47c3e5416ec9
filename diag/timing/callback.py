"""TimingCallback: `Trainer(..., callbacks=[cb := diag.TimingCallback()])`; `cb.frame()` is a
StageTimer frame (per step data_wait, compute, under DDP comm_wait; setup, warmup, train, ...).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from diag.machine import device as devices
from diag.timing.timer import StageTimer, find_ddp

if TYPE_CHECKING:
    import pandas as pd


class TimingCallback(TrainerCallback):
    """Times each Trainer step from its hooks, the first `warmup_steps` as `warmup`."""

    def __init__(self, timer: StageTimer | None = None, warmup_steps: int = 1,
                 device: Any = None) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r}: must be a whole number >= 0")
        self.timer = timer if timer is not None else StageTimer()
        self.warmup_steps, self.device, self._sync = warmup_steps, device, None
        # CPU seconds in warmup and train (a CPU's step clock), read at their ends: per step costs
        self.cpu, self._cpu_mark = {"warmup": 0.0, "train": 0.0}, 0.0
        self._mark: float | None = None  # end of the last step, save or eval
        self._begin = self._wait = self._gather = 0.0  # _gather: the token-count gather (DDP)
        self._steady_start: float | None = None
        self._side = 0.0  # checkpoint + eval seconds inside the steady loop
        self._first = self.steps = 0
        self.setup_from: float | None = None  # perf_counter() before the Trainer: `setup` from it
        self.trainer: Any = None  # the Trainer, under DDP: comm hook and clocked batch fetch
        self._fetched: float | None = None  # when this step's last batch arrived (DDP)

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()  # note: CPU-GPU sync point: a step's queued kernels are billed to it
        return time.perf_counter()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        device = self.device if self.device is not None else getattr(args, "device", None)
        if device is not None and devices.is_async(device):
            self._sync = lambda: devices.sync(device)
        ddp = find_ddp(getattr(self.trainer, "model_wrapped", None), kwargs.get("model"))
        if ddp is not None and self.timer.comm is None:  # before the first forward
            self.timer.watch_comm(ddp)
            self._clock_fetch(self.trainer)
        self._mark = self._now()  # the first wait includes the loader's start-up
        self._cpu_mark = time.process_time()
        if self.setup_from is not None:
            self.timer.record("setup", max(self._mark - self.setup_from, 0.0))
            self.setup_from = None
        self._first = state.global_step  # a resumed run warms up again
        self._steady_start = self._mark if self.warmup_steps == 0 else None
        self._side = 0.0

    def _clock_fetch(self, trainer: Any) -> None:
        """Note when a step's batches arrive: the Trainer then waits on every rank's token count."""
        fetch = getattr(trainer, "get_batch_samples", None)
        if fetch is None or getattr(fetch, "diag_clocked", False):
            return

        def arrivals(batches: Any) -> Any:
            for batch in batches:
                self._fetched = time.perf_counter()
                yield batch

        def clocked(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            return fetch(arrivals(epoch_iterator), num_batches, device)

        clocked.diag_clocked = True  # type: ignore[attr-defined]
        trainer.get_batch_samples = clocked

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = self._now()
        mark = self._mark if self._mark is not None else now
        self._gather = 0.0
        if self.timer.comm is not None:
            self.timer.comm.take()  # waits before this step (an eval's) are not its own
            if self._fetched is not None and mark <= self._fetched <= now:
                self._gather = now - self._fetched
        self._fetched = None
        self._wait, self._begin = now - mark - self._gather, now

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = self._now()
        step = state.global_step - 1  # already counted
        if step - self._first < self.warmup_steps:
            self.timer.record("warmup", self._wait + self._gather + now - self._begin)
            if step - self._first == self.warmup_steps - 1:
                self._steady_start = now
                self._cpu_stage("warmup")
        else:
            self.timer.step_done(step, self._wait, now - self._begin, self._gather)
        self.timer.flush()  # under a launcher: the finished step survives a kill
        self.steps += 1
        self._mark = now

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        # logging shows as `other` inside train; eval logs before on_evaluate: keep the mark
        if not any(str(k).startswith("eval_") for k in (logs or {})):
            self._mark = self._now()

    def _side_stage(self, name: str) -> None:
        now = self._now()
        if self._mark is not None:
            self.timer.record(name, now - self._mark)
            if self._steady_start is not None:
                self._side += now - self._mark
        self._mark = now

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._side_stage("eval")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._side_stage("checkpoint")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._steady_start is None:  # every step was warm-up
            return
        end = self._mark if self._mark is not None else self._now()
        self.timer.record("train", max(end - self._steady_start - self._side, 0.0))
        self._cpu_stage("train")

    def _cpu_stage(self, stage: str) -> None:
        cpu = time.process_time()
        self.cpu[stage] += cpu - self._cpu_mark
        self._cpu_mark = cpu

    def frame(self) -> pd.DataFrame:
        """The StageTimer frame: stage, seconds, step (<NA>: run-level), rank, node."""
        return self.timer.to_frame()
