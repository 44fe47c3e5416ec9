"""The live view of a long QLoRA run on stderr: a tqdm.auto bar whose time left is the cost
table's ETA with the steps' own pace replacing their price, and the stage shares every N steps."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from transformers import TrainerCallback

from diag.runner import say  # stderr beside the bar; text in a kernel
from diag.timing import STEP_STAGES, StageTimer


def shares_so_far(timer: StageTimer) -> str:
    """Each stage's share of the seconds recorded so far, largest first ("compute 91%, ...")."""
    frame = timer.to_frame()
    spent = frame[frame["stage"] != "train"].groupby("stage")["seconds"].sum()
    total = spent.sum()
    if not total > 0:
        return "nothing timed yet"
    return ", ".join(f"{stage} {seconds / total:.1%}"
                     for stage, seconds in spent.sort_values(ascending=False).items())


def left_s(projected: dict[str, float], spent: dict[str, float], steps_left: int,
           step_s: float | None) -> float:
    """The steps left at the pace measured (else the ETA's), and each later stage's ETA left."""
    steps = steps_left * step_s if step_s else max(
        0.0, projected.get("train", 0.0) + projected.get("warmup", 0.0)
        - spent.get("train", 0.0) - spent.get("warmup", 0.0))
    rest = sum(max(0.0, s - spent.get(stage, 0.0)) for stage, s in projected.items()
               if stage not in ("train", "warmup", "fetch_data", "load_model", "preprocess",
                                "setup"))
    return steps + rest


class Progress(TrainerCallback):
    """The bar (steps, trained tokens/s, data_wait, diag's time left) and the periodic shares;
    projected: the ETA's seconds per stage (None: no time left shown)."""

    def __init__(self, timer: StageTimer, tokens_per_step: float, every: int,
                 desc: str = "diag train", projected: dict[str, float] | None = None) -> None:
        self.timer, self.tokens_per_step, self.every = timer, tokens_per_step, every
        self.desc, self.projected = desc, projected
        self.bar: Any = None
        self._start, self._first = 0.0, 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, initial=state.global_step, unit="step",
                        desc=self.desc, dynamic_ncols=True, file=sys.stderr,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        self._start, self._first = time.perf_counter(), state.global_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from diag.forecast.eta import duration

        step = state.global_step
        frame = self.timer.to_frame()
        spent = frame[frame["step"].isna()].groupby("stage")["seconds"].sum().to_dict()
        stepped = frame[frame["stage"].isin(STEP_STAGES) & frame["step"].notna()]
        per = stepped.groupby("step")["seconds"].sum()
        wait = stepped.loc[stepped["stage"] == "data_wait", "seconds"].sum()
        rate = self.tokens_per_step * (step - self._first) / (time.perf_counter() - self._start)
        said = f"{rate:,.0f} trained tokens/s, data_wait {wait / per.sum() if per.sum() else 0:.1%}"
        if self.projected is not None:
            step_s = statistics.median(per.tail(20)) if len(per) else None
            left = left_s(self.projected, spent, state.max_steps - step, step_s)
            said += f", {duration(left)} left (diag's ETA)"
        self.bar.set_postfix_str(said, refresh=False)
        self.bar.update(1)
        if self.every and step % self.every == 0 and step < state.max_steps:
            say(f"step {step}: stage shares so far: {shares_so_far(self.timer)}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
