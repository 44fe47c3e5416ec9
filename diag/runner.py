"""Runs a recipe's steps in turn, each step's product assigned into one frozen dataclass.

A recipe (diag.diagnose) hands each step to the runner as `run(result, step, make)`: make() is
the step's product, assigned into the result's `step.field`. The runner owns what every step
shares: the progress bar, Stop (an Event checked before each step) and on_error (a step that
raises is handed to it and the recipe goes on without that product). Inside a step the
libraries' own bars (transformers' "Loading weights", huggingface_hub's "Fetching N files") are
off, by their own switches: diag's bar is the one a person watches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class Step:
    name: str  # what the progress bar and the panel show
    field: str  # the result's field its product fills (and the name of its frames)


class Stopped(BaseException):
    """The recipe was stopped (the panel's Stop); a BaseException so that no step's error
    handling swallows it. Nothing is written: a run folder appears whole or not at all."""


@dataclass
class Runner:
    """run(result, step, make) -> result with step.field = make(). stop: once set, the next step
    raises Stopped. on_error(step, error): a step that raises is handed to it and the result
    goes on without its product (without it the error propagates). on_result(step, result):
    after each step that finished."""

    bar: Any  # tqdm.auto over the steps the recipe will hand it
    on_result: Callable[[Step, Any], None] | None = None
    stop: threading.Event | None = None
    on_error: Callable[[Step, Exception], None] | None = None

    def __call__(self, result: R, step: Step, make: Callable[[], Any]) -> R:
        if self.stop is not None and self.stop.is_set():
            raise Stopped(f"stopped before {step.name}")
        self.bar.set_postfix_str(step.name)
        try:
            with library_bars_off():
                result = dataclasses.replace(result, **{step.field: make()})
        except Exception as error:
            if self.on_error is None:
                raise
            self.on_error(step, error)
            return result
        finally:
            self.bar.update()
        if self.on_result is not None:
            self.on_result(step, result)
        return result


@contextlib.contextmanager
def library_bars_off() -> Iterator[None]:
    """transformers' and huggingface_hub's progress bars off for the block, as each was after.

    huggingface_hub's switch is process-wide, and transformers, imported inside the block,
    starts with its bars as huggingface_hub's are then: both are put back as they were before.
    """
    try:
        from huggingface_hub import utils as hub
    except ImportError:  # not installed: no bars of theirs to silence
        yield
        return
    hub_off = hub.are_progress_bars_disabled()
    before = sys.modules.get("transformers.utils.logging")
    transformers_on = before.is_progress_bar_enabled() if before else not hub_off
    if before is not None:
        before.disable_progress_bar()
    hub.disable_progress_bars()
    try:
        yield
    finally:
        after = sys.modules.get("transformers.utils.logging")
        if after is not None:  # its enable/disable sets huggingface_hub's too: that goes last
            (after.enable_progress_bar if transformers_on else after.disable_progress_bar)()
        (hub.disable_progress_bars if hub_off else hub.enable_progress_bars)()
