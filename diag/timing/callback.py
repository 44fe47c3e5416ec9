"""TimingCallback: drop into any transformers Trainer to see where its wall clock goes.

`Trainer(..., callbacks=[diag.TimingCallback()])`, then `callback.frame()` is a StageTimer frame
(`stage`, `seconds`, `step`, `rank`) that `diag.amdahl.shares` reads: per optimizer step
`data_wait` (from one step's end to the next step's begin, where the Trainer pulls that step's
batches) and `compute` (forward, backward, optimizer); run-level `setup` (from `setup_from`,
when set, to on_train_begin: the Trainer's own set-up), `warmup` (the first steps, start-up
included), `checkpoint`, `eval` and `train` (the steady-state loop around the steps).
Under torchrun / accelerate (DDP) each rank's rows carry its rank and node, and with
`callback.trainer = trainer` its waits on the other ranks are `comm_wait`: the Trainer's token-count
gather after the step's batches are fetched, DDP's buffer broadcast and the gradient all-reduce.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from diag.timing.timer import StageTimer


class TimingCallback(TrainerCallback):
    """Times each Trainer step from its hooks; costs two clock reads per step (on CUDA two syncs).

    warmup_steps: the first optimizer steps (data loader start-up, allocator, kernel selection)
    are billed to the run-level `warmup` stage, apart from steady state. device: "cuda" makes
    each step boundary a sync point, so queued kernels are billed to the step that queued them;
    None uses the Trainer's device.
    """

    def __init__(self, timer: StageTimer | None = None, warmup_steps: int = 1,
                 device: Any = None) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r}: must be a whole number >= 0")
        self.timer = timer if timer is not None else StageTimer()
        self.warmup_steps = warmup_steps
        self.device = device
        self._sync: Any = None
        self._mark: float | None = None  # end of the last timed thing: a step, a save, an eval
        # this process's CPU seconds (time.process_time: all its threads; DataLoader workers are
        # other processes) in the warm-up and the steady loop (its logging and saves in it): on a
        # CPU device the steps' own work, which the load barely moves (their wall seconds move
        # 1.5-5x). Read at those two stages' ends alone: a read is a system call, and under load
        # the scheduler takes the CPU back there (1.8 ms per step in the hooks, read per step)
        self.cpu = {"warmup": 0.0, "train": 0.0}
        self._cpu_mark = 0.0
        self._begin = 0.0
        self._wait = 0.0
        self._gather = 0.0  # of this step: the token-count gather's wait (under DDP)
        self._steady_start: float | None = None
        self._side = 0.0  # checkpoint + eval seconds inside the steady loop (not train's)
        self._first = 0
        self.steps = 0
        # set to time.perf_counter() before building the Trainer: on_train_begin bills the
        # Trainer's own set-up (wrap, optimizer, data loader) from there to the `setup` stage
        self.setup_from: float | None = None
        self.trainer: Any = None  # set to the Trainer under DDP: its wrapped model
                                  # gets the comm hook, its batch fetch is clocked
        self._fetched: float | None = None  # when this step's last batch arrived (under DDP)

    # -- clock ------------------------------------------------------------------------------
    def _now(self) -> float:
        if self._sync is not None:
            self._sync()  # note: CPU-GPU sync point, so a step's queued kernels are billed to it
        return time.perf_counter()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from diag.machine import device as devices

        device = self.device if self.device is not None else getattr(args, "device", None)
        if device is not None and devices.is_async(device):
            self._sync = lambda: devices.sync(device)
        from diag.timing.comm import find_ddp

        ddp = find_ddp(getattr(self.trainer, "model_wrapped", None), kwargs.get("model"))
        if ddp is not None and self.timer.comm is None:  # before the first forward
            self.timer.watch_comm(ddp)
            self._clock_fetch(self.trainer)
        self._mark = self._now()  # the first step's wait includes the loader's start-up
        self._cpu_mark = time.process_time()
        if self.setup_from is not None:
            self.timer.record("setup", max(self._mark - self.setup_from, 0.0))
            self.setup_from = None  # a second train() call sets it again
        self._first = state.global_step  # a resumed run warms up again from where it resumed
        self._steady_start = self._mark if self.warmup_steps == 0 else None
        self._side = 0.0

    def _clock_fetch(self, trainer: Any) -> None:
        """Note when the Trainer has a step's batches in hand: between then and on_step_begin it
        gathers every rank's token count, a collective that waits for the slowest loader."""
        fetch = getattr(trainer, "get_batch_samples", None)
        if fetch is None or getattr(fetch, "diag_clocked", False):
            return

        def clocked(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            return fetch(self._arrivals(epoch_iterator), num_batches, device)

        clocked.diag_clocked = True  # type: ignore[attr-defined]  # a second train() keeps one
        trainer.get_batch_samples = clocked

    def _arrivals(self, batches: Any) -> Any:
        for batch in batches:
            self._fetched = time.perf_counter()
            yield batch

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = self._now()
        mark = self._mark if self._mark is not None else now
        self._gather = 0.0
        if self.timer.comm is not None:
            self.timer.comm.take()  # waits before this step (an eval's forward) are not its own
            if self._fetched is not None and mark <= self._fetched <= now:
                self._gather = now - self._fetched  # the count gather: waiting on other ranks
        self._fetched = None
        self._wait = now - mark - self._gather
        self._begin = now

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = self._now()
        step = state.global_step - 1  # the Trainer counted this step before calling us
        if step - self._first < self.warmup_steps:
            self.timer.record("warmup", self._wait + self._gather + now - self._begin)
            if step - self._first == self.warmup_steps - 1:
                self._steady_start = now
                self._cpu_stage("warmup")
        else:
            # under DDP the waits on other ranks (the count gather before the step, the buffer
            # broadcast and the exposed all-reduce inside it) are comm_wait, not compute
            inside = min(self.timer.comm.take(), now - self._begin) if self.timer.comm else None
            self.timer.record("data_wait", self._wait, step=step)
            if inside is not None:
                self.timer.record("comm_wait", self._gather + inside, step=step)
            self.timer.record("compute", now - self._begin - (inside or 0.0), step=step)
        self.timer.flush()  # under a launcher: the finished step survives a kill
        self.steps += 1
        self._mark = now

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        # logging is per-step overhead: the gap it leaves shows as `other` inside `train`; an
        # evaluation logs its metrics before on_evaluate, so it must not move the mark
        if not any(str(k).startswith("eval_") for k in (logs or {})):
            self._mark = self._now()

    def _side_stage(self, name: str) -> None:
        now = self._now()
        if self._mark is not None:
            seconds = now - self._mark
            self.timer.record(name, seconds)
            if self._steady_start is not None:
                self._side += seconds
        self._mark = now

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._side_stage("eval")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._side_stage("checkpoint")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._steady_start is None:  # every step was a warm-up step
            return
        end = self._mark if self._mark is not None else self._now()
        self.timer.record("train", max(end - self._steady_start - self._side, 0.0))
        self._cpu_stage("train")

    def _cpu_stage(self, stage: str) -> None:
        cpu = time.process_time()
        self.cpu[stage] += cpu - self._cpu_mark
        self._cpu_mark = cpu

    def frame(self):  # -> pandas.DataFrame
        """The StageTimer frame: stage, seconds, step (<NA> for run-level), rank."""
        return self.timer.to_frame()
