"""The live view of a long QLoRA run: a tqdm.auto bar, and the stage shares so far every N steps.

`Progress(timer, tokens_per_step, every)` is a TrainerCallback: the bar counts optimizer steps
(resumed ones included) with trained tokens/s and the data_wait share of the steps so far in its
postfix (tqdm's own ETA from the rate beside it); every `every` steps a line with the
TimingCallback timer's stage shares so far (`say` writes such a line). tqdm.auto draws it in a
terminal and in a notebook alike; on stderr, so a --json result on stdout stays JSON.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from transformers import TrainerCallback

from diag.runner import say  # stderr beside the bar; text in a kernel
from diag.timing import StageTimer

STEP_PARTS = ("data_wait", "h2d", "compute", "comm_wait", "other")


def shares_so_far(timer: StageTimer) -> str:
    """Each stage's share of the seconds recorded so far, largest first ("compute 91%, ...")."""
    frame = timer.to_frame()
    spent = frame[frame["stage"] != "train"].groupby("stage")["seconds"].sum()
    total = spent.sum()
    if not total > 0:
        return "nothing timed yet"
    return ", ".join(f"{stage} {seconds / total:.1%}"
                     for stage, seconds in spent.sort_values(ascending=False).items())


class Progress(TrainerCallback):
    """The bar and the periodic stage shares (see the module)."""

    def __init__(self, timer: StageTimer, tokens_per_step: float, every: int,
                 desc: str = "diag train") -> None:
        self.timer, self.tokens_per_step, self.every = timer, tokens_per_step, every
        self.desc = desc
        self.bar: Any = None
        self._start, self._first = 0.0, 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, initial=state.global_step, unit="step",
                        desc=self.desc, dynamic_ncols=True, file=sys.stderr)
        self._start, self._first = time.perf_counter(), state.global_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        done = state.global_step - self._first
        spent = {s: self.timer.total(s) for s in STEP_PARTS}
        steps = sum(spent.values())
        self.bar.set_postfix_str(
            f"{self.tokens_per_step * done / (time.perf_counter() - self._start):,.0f} "
            f"trained tokens/s, data_wait {spent['data_wait'] / steps if steps else 0:.1%}",
            refresh=False)
        self.bar.update(1)
        if self.every and state.global_step % self.every == 0 and state.global_step < \
                state.max_steps:
            say(f"step {state.global_step}: stage shares so far: {shares_so_far(self.timer)}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
