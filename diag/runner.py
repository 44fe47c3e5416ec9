"""Runs a recipe's steps into one frozen dataclass (`Runner`), and keeps diag's calls quiet
(`quiet`): the libraries' bars off, HARMLESS warnings ignored, in a kernel bars closed into text.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import html
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from diag.secrets import redact

R = TypeVar("R")
VIEW = "application/vnd.jupyter.widget-view+json"

# Library warnings known harmless, ignored in quiet() only: (category, pattern, why harmless)
HARMLESS = (
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated",
     "peft's get_peft_model reads transformers 5's old name; it returns the new name's value"),
)


@dataclass(frozen=True)
class Step:
    name: str  # what the progress bar and the panel show
    field: str  # the result's field its product fills (and the name of its frames)


class Stopped(BaseException):
    """The panel's Stop; a BaseException, so no step's error handling swallows it."""


@dataclass
class Runner:
    """run(result, step, make): result with step.field = make(), under quiet(), stop, on_error."""

    bar: Any  # tqdm.auto over the recipe's steps
    on_result: Callable[[Step, Any], None] | None = None
    stop: threading.Event | None = None
    on_error: Callable[[Step, Exception], None] | None = None

    def __call__(self, result: R, step: Step, make: Callable[[], Any]) -> R:
        if self.stop is not None and self.stop.is_set():
            raise Stopped(f"stopped before {step.name}")
        self.bar.set_postfix_str(step.name)
        try:
            with quiet():
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
def quiet(log: Any = None) -> Iterator[None]:
    """The libraries' bars off, HARMLESS ignored, lines and bars in `log` (bars_into)."""
    with warnings.catch_warnings(), library_bars_off(), bars_into(log):
        for category, pattern, _why in HARMLESS:
            warnings.filterwarnings("ignore", pattern, category)
        yield


# `@quietly`: an experiment's entry point, each call under a fresh quiet() (ContextDecorator)
quietly = quiet()


def in_kernel() -> bool:
    """Whether tqdm.auto draws widgets here (a Jupyter kernel)."""
    if "IPython" not in sys.modules:  # no kernel (and no widget import paid to say so)
        return False
    from tqdm import auto, notebook

    return issubclass(auto.tqdm, notebook.tqdm_notebook)


def say(text: str, table: Any = None) -> None:
    """Lines beside the bar: stderr in a terminal; in a kernel quiet()'s log (`table` under it)."""
    if not in_kernel():
        from tqdm.auto import tqdm

        tqdm.write(text, file=sys.stderr)
        return
    data = {"text/plain": redact(text)}
    if table is not None:
        title = html.escape(text.splitlines()[0].rstrip(":"))
        data["text/html"] = redact(f"<p><b>{title}</b></p>" + table.to_html(
            index=False, na_rep="", float_format="{:.3g}".format))
    log = _LOG.get()
    if log is not None and not (log.cell and table is not None):  # a cell's log ends as text
        log.append(data)
        return
    from IPython.display import display

    display(data, raw=True)


@dataclass
class Log:
    """A bars_into block's Output (`cell`: ours, shown at its first line) and bars by id."""
    out: Any
    cell: bool
    handle: Any = None  # the cell's display of `out`, once shown
    bars: dict[str, Any] = dataclasses.field(default_factory=dict)

    def append(self, data: dict[str, Any]) -> None:
        if self.cell and self.handle is None:
            from IPython.display import display

            self.handle = display(self.out, display_id=True)
        self.out.outputs = self.kept() + (_output(data),)

    def add(self, bar: Any) -> None:  # tqdm.notebook's display(bar)
        self.bars[bar.model_id] = bar
        self.append({VIEW: {"version_major": 2, "version_minor": 0, "model_id": bar.model_id},
                     "text/plain": _line(bar)})

    def kept(self, end: bool = False) -> tuple[dict[str, Any], ...]:
        """The outputs but closed bars; end: the open bars, or else the last, as text."""
        out = []
        for o in self.out.outputs:
            bar = self.bars.get(o.get("data", {}).get(VIEW, {}).get("model_id"))
            if bar is None or bar.comm is not None:
                out.append(_output({"text/plain": _line(bar)}) if end and bar is not None else o)
        if end and self.bars and all(b.comm is None for b in self.bars.values()):
            out.append(_output({"text/plain": _line(list(self.bars.values())[-1])}))
        return tuple(out)


def _output(data: dict[str, Any]) -> dict[str, Any]:
    return {"output_type": "display_data", "metadata": {}, "data": data}


def _line(bar: Any) -> str:
    """A notebook bar's text now: "storage: 100% 3/3 [00:02<00:00, 1.2s/round]"."""
    left, _, right = bar.children
    return " ".join(html.unescape(f"{left.value} {right.value}").split())


@contextlib.contextmanager
def bars_into(log: Any = None) -> Iterator[None]:
    """In a kernel, say() lines and tqdm.auto bars in `log` (None: an Output in the cell)."""
    if _LOG.get() is not None or not in_kernel():
        yield
        return
    import ipywidgets
    import tqdm.notebook as notebook

    state = Log(log if log is not None else ipywidgets.Output(), cell=log is None)
    token, shown = _LOG.set(state), notebook.display

    def display(obj: Any, *args: Any, **kwargs: Any) -> None:
        mine = _LOG.get()  # a bar made in another context goes where it went before
        return shown(obj, *args, **kwargs) if mine is None else mine.add(obj)

    notebook.display = display
    try:
        yield
    finally:
        notebook.display = shown
        _LOG.reset(token)
        state.out.outputs = state.kept(end=True)
        for widget in (w for bar in state.bars.values() for w in (bar, *bar.children)):
            widget.close()  # each bar is text now
        if state.handle is not None:
            state.handle.update({"text/plain": "\n".join(
                o["data"]["text/plain"] for o in state.out.outputs)}, raw=True)
            state.out.close()


_LOG: contextvars.ContextVar[Log | None] = contextvars.ContextVar("diag_log", default=None)


@contextlib.contextmanager
def library_bars_off() -> Iterator[None]:
    """transformers' and huggingface_hub's bars off for the block, then as each was."""
    try:
        from huggingface_hub import utils as hub
    except ImportError:  # no bars of theirs
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
