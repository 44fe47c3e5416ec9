"""The Trainer as `diag qlora` and `diag train` run it: its arguments from the plan, checkpoints
written whole, a signal turned into a checkpoint and a stop, every stage timed, and the live view
on stderr (`progress_callback`: the ETA left at the steps' own pace, the stage shares)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.forecast.eta import duration
from diag.qlora.checkpoints import Interrupted, save_whole
from diag.runner import say  # stderr beside the bar; text in a kernel
from diag.timing import STEP_STAGES
from diag.timing.distributed import launched, spill_ranks

if TYPE_CHECKING:
    from diag.config import JobConfig
    from diag.qlora.plans import Plan
    from diag.timing import StageTimer


def training_args(cfg: JobConfig, plan: Plan, data: Any, out_dir: Path, device: Any,
                  **more: Any) -> Any:
    """The Trainer's arguments for plan over data; `more` sets or overrides any."""
    from transformers import TrainingArguments

    workers, steps = plan.num_workers, more.get("max_steps", getattr(cfg, "steps", 1))
    return TrainingArguments(**{
        "output_dir": str(out_dir), "max_steps": steps,
        "per_device_train_batch_size": data.micro_batch,
        "gradient_accumulation_steps": data.grad_accum, "learning_rate": cfg.lr,
        "lr_scheduler_type": "linear", "warmup_steps": max(1, round(0.1 * steps)),
        "seed": cfg.seed, "data_seed": cfg.seed, "logging_steps": 1, "report_to": [],
        "disable_tqdm": True, "save_strategy": "steps",
        "save_steps": cfg.checkpoint_every or steps, "save_total_limit": 2,  # the newest kept
        "use_cpu": device.type == "cpu", "dataloader_num_workers": workers,
        "dataloader_pin_memory": plan.pin_memory,
        "dataloader_persistent_workers": plan.persistent_workers and workers > 0,
        "dataloader_prefetch_factor": plan.prefetch_factor if workers > 0 else None,
        "ddp_find_unused_parameters": False,  # every LoRA weight gets a gradient: no graph walk
        "remove_unused_columns": False,  # checkpointing: as prepare_model_for_kbit_training set
    } | more)


def trainer_for(cfg: JobConfig, plan: Plan, model: Any, data: Any, out_dir: Path, device: Any,
                timer: StageTimer, callbacks: tuple[Any, ...] = (),
                **more: Any) -> tuple[Any, Any]:
    """(the Trainer, its TimingCallback); more: training_args' overrides, or the datasets."""
    import transformers
    from diag.timing.callback import TimingCallback

    spill_ranks(timer)  # under a launcher: each finished step on disk until the gather
    own = {k: more.pop(k) for k in ("train_dataset", "eval_dataset") if k in more}
    callback = TimingCallback(timer, warmup_steps=cfg.warmup_steps, device=device)
    callback.setup_from = time.perf_counter()  # the Trainer's set-up is `setup`
    transformers.logging.set_verbosity_error()
    args = training_args(cfg, plan, data, out_dir, device, **more)
    trainer = trainer_class()(model=model, args=args, callbacks=[
        callback, signals_callback()(), *callbacks], **({"train_dataset": data.dataset} | own))
    trainer.made_at = callback.setup_from
    callback.trainer = trainer  # under DDP: its wrapped model and its batch fetch are clocked
    # the Trainer prints every log line with tqdm off; a function in diag prints nothing
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer, callback


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """What is alive frozen out of the garbage collector: train()'s gc.collect() walks the rest."""
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


def fit(trainer: Any, callback: Any, resume: Path | None, out_dir: Path | None) -> float:
    """trainer.train() from `resume`: its wall seconds; stopped by a signal: Interrupted."""
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    wall = time.perf_counter() - trainer.made_at
    end_workers(trainer)
    signals = next(c for c in trainer.callback_handler.callbacks
                   if isinstance(c, signals_callback()))
    if signals.signum is not None:
        raise Interrupted(signals.signum, trainer.state.global_step, out_dir)
    return wall


def end_workers(trainer: Any) -> None:
    """Shut its loaders' workers down now, not in whatever runs next (torch's 5 s join timeout)."""
    for loader in trainer.accelerator._dataloaders:
        if getattr(loader, "_iterator", None) is not None:
            loader._iterator._shutdown_workers()


@functools.cache
def trainer_class() -> type:
    """transformers.Trainer whose checkpoints are written whole (save_whole)."""
    import transformers

    class Trainer(transformers.Trainer):
        made_at = 0.0  # time.perf_counter() before it was made: its wall clock starts there
        _staging: Path | None = None

        def _get_output_dir(self, trial: Any) -> str:
            return str(self._staging) if self._staging else super()._get_output_dir(trial)

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            name = f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            if self.args.world_size > 1:  # every rank writes its own files into one folder, as
                # the Trainer does: rank 0's trainer_state.json, written last, marks it whole
                return super()._save_checkpoint(model, trial)

            def write(tmp: Path) -> None:
                self._staging = tmp
                try:
                    super(Trainer, self)._save_checkpoint(model, trial)
                finally:
                    self._staging = None
                for part in (tmp / name).iterdir():
                    os.replace(part, tmp / part.name)
                (tmp / name).rmdir()

            save_whole(Path(super()._get_output_dir(trial)) / name, write,
                       self.args.save_total_limit)

    return Trainer


@functools.cache
def signals_callback() -> type:
    """SIGINT / SIGTERM into a checkpoint at the step's end and a stop; a second stops at once."""
    from transformers import TrainerCallback

    class Signals(TrainerCallback):
        def __init__(self) -> None:
            self.signum: int | None = None
            self._old: dict[int, Any] = {}

        def _caught(self, signum: int, frame: Any) -> None:
            if self.signum is not None:  # asked twice: stop now, without a checkpoint
                raise KeyboardInterrupt
            self.signum = signum

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # launched, a rank stops at once: ranks stopped at different steps would deadlock
            if threading.current_thread() is threading.main_thread() and not launched():
                self._old = {s: signal.signal(s, self._caught)
                             for s in (signal.SIGINT, signal.SIGTERM)}

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.signum is not None:
                control.should_save = control.should_training_stop = True

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            for s, old in self._old.items():
                signal.signal(s, old)
            self._old = {}

    return Signals


def left_s(projected: dict[str, float], spent: dict[str, float], steps_left: int,
           step_s: float | None, steps: int) -> float:
    """Seconds left: the steps at step_s (None: as priced), evals at that pace, saves as priced."""
    priced = projected.get("train", 0.0) + projected.get("warmup", 0.0)
    pace = step_s * steps / priced if step_s and priced else 1.0
    left = steps_left * step_s if step_s else max(
        0.0, priced - spent.get("train", 0.0) - spent.get("warmup", 0.0))
    return left + sum(max(0.0, s * (pace if stage == "eval" else 1.0) - spent.get(stage, 0.0))
                      for stage, s in projected.items() if stage not in (
                          "train", "warmup", "fetch_data", "load_model", "preprocess", "setup"))


@functools.cache
def progress_callback() -> type:
    """The bar (tokens/s, data_wait, time left), the command's ETA, the shares every `every`."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def __init__(self, timer: StageTimer, tokens_per_step: float, every: int, desc: str,
                     projected: dict[str, float], began: float) -> None:
            self.timer, self.tokens_per_step, self.every = timer, tokens_per_step, every
            self.desc, self.projected, self.began = desc, projected, began
            self.bar: Any = None
            self.promised: float | None = None  # the first ETA, the whole command's wall seconds
            self._gaps: list[float] = []  # the last 100 steps' walls, end to end
            self._first, self._shown, self._timed, self._timed_s = 0, 0.0, 0, 0.0  # all gaps
            self._end: float | None = None  # the last step's end
            self._aside: float | None = None  # eval + checkpoint seconds then, if it ran either

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, unit="step",
                            desc=self.desc, dynamic_ncols=True, file=sys.stderr,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
            self._first = state.global_step

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step, now, last = state.global_step, time.perf_counter(), state.max_steps
            if self._end is not None:  # none before step 1 (the warm-up); an eval's or save's off
                off = self._side() - self._aside if self._aside is not None else 0.0
                self._gaps = [*self._gaps[-99:], now - self._end - off]
                self._timed, self._timed_s = self._timed + 1, self._timed_s + self._gaps[-1]
            self._end = now
            self._aside = self._side() if control.should_evaluate or control.should_save else None
            # the mean step, callbacks and optimizer included, prices the steps left; the first
            # ETA waits for a tenth of the run (at least 10 steps, fewer in a short run) or 2 min
            gaps, span = self._gaps, last - self._first
            step_s = statistics.fmean(gaps) if gaps else None
            self.bar.update(1)
            promise = self.promised is None and self._timed >= min(10, max(1, span // 5)) and (
                self._timed >= span / 10 or self._timed_s >= 120)  # a long run: past the window
            shares = self.every and step % self.every == 0 and step < last
            if not (promise or shares or now - self._shown >= 1.0 or step == last):
                return  # the frame costs O(steps): at most once a second
            self._shown, frame = now, self.timer.to_frame()
            spent = frame[frame["step"].isna()].groupby("stage")["seconds"].sum().to_dict()
            left = left_s(self.projected, spent, last - step, step_s, last)
            stepped = frame[frame["stage"].isin(STEP_STAGES) & frame["step"].notna()]
            wait, busy = (stepped.loc[stepped["stage"] == "data_wait", "seconds"].sum(),
                          stepped["seconds"].sum())
            rate = f"{self.tokens_per_step / step_s:,.0f} trained tokens/s, " if step_s else ""
            self.bar.set_postfix_str(f"{rate}data_wait {wait / busy if busy else 0:.1%}, "
                                     f"{duration(left)} left (diag's ETA)")
            if promise:
                self.promised = now - self.began + left
                say(f"diag train: ETA {duration(self.promised)} (wall) for the whole command, "
                    f"{duration(now - self.began)} of it spent (deciding the plan, fetch, load, "
                    f"preprocess, the first {step - self._first} steps); this run's steps at "
                    f"{step_s:.3g} s each (mean of {len(gaps)})")
            if shares:  # each stage's share so far, largest first (`train` holds the steps')
                by = frame[frame["stage"] != "train"].groupby("stage")["seconds"].sum()
                said = ", ".join(f"{stage} {s / by.sum():.1%}" for stage, s in
                                 by.sort_values(ascending=False).items()) if by.sum() > 0 else ""
                say(f"step {step}: stage shares so far: {said or 'nothing timed yet'}")

        def _side(self) -> float:
            return self.timer.total("eval") + self.timer.total("checkpoint")

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.bar is not None:
                self.bar.close()

    return Progress
