"""The runner every recipe step goes through, and quiet(): inside a step the libraries' own
progress bars are silent (diag's bar is the one shown) and only the warnings diag names harmless
are ignored; in a notebook its bars close into text and its lines never reach stderr."""

from __future__ import annotations

import functools
import io
import warnings
from dataclasses import dataclass

import pandas as pd
import pytest
from tqdm.auto import tqdm

from diag import runner
from diag.runner import HARMLESS, Runner, Step, quiet


@dataclass(frozen=True)
class Product:
    drawn: str = ""


def _bars() -> str:
    """What transformers' "Loading weights" and huggingface_hub's "Fetching" bars draw."""
    from huggingface_hub.utils import tqdm as hub_tqdm
    from transformers.utils import logging

    out = io.StringIO()
    for bar in (logging.tqdm(range(3), desc="Loading weights", file=out),
                hub_tqdm(range(3), desc="Fetching 3 files", file=out)):
        list(bar)
        bar.close()
    return out.getvalue()


def test_library_bars_are_silent_inside_a_step_and_back_after():
    assert "Loading weights" in _bars() and "Fetching 3 files" in _bars()
    with tqdm(total=1, disable=True) as bar:
        got = Runner(bar)(Product(), Step("load", "drawn"), _bars)
    assert got.drawn == ""
    assert "Loading weights" in _bars() and "Fetching 3 files" in _bars()


def test_quiet_ignores_only_the_warnings_named_harmless_and_only_inside():
    named = "`is_gradient_checkpointing` is deprecated and will be removed in v6."
    assert any(c is FutureWarning for c, _, why in HARMLESS if why)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn = functools.partial(warnings.warn, stacklevel=1)
        with quiet():
            warn(named, FutureWarning)
            warn("`gradient_checkpointing_enable` is deprecated", FutureWarning)
            warn(named, UserWarning)  # the same words in another category
        warn(named, FutureWarning)  # outside: the user's own code still hears it
    assert [(w.category, str(w.message)[:40]) for w in seen] == [
        (FutureWarning, "`gradient_checkpointing_enable` is depre"),
        (UserWarning, named[:40]), (FutureWarning, named[:40])]


def test_a_line_outside_a_kernel_goes_to_stderr_beside_the_bar(capsys):
    runner.say("diag run: budget 1m, the plan:\n  storage  7 s", pd.DataFrame({"step": ["x"]}))
    out, err = capsys.readouterr()
    assert out == "" and err == "diag run: budget 1m, the plan:\n  storage  7 s\n"


def _kernel_bars(monkeypatch) -> object:
    """tqdm.auto's notebook bars without a kernel: ipywidgets' own widgets, no front end."""
    import tqdm.auto
    import tqdm.notebook

    pytest.importorskip("ipywidgets")
    monkeypatch.setattr(tqdm.auto, "tqdm", tqdm.notebook.tqdm_notebook)
    monkeypatch.setattr(runner, "in_kernel", lambda: True)
    return tqdm.notebook.tqdm_notebook


def test_in_a_notebook_bars_close_into_their_line_and_lines_are_text(monkeypatch):
    import ipywidgets

    bar = _kernel_bars(monkeypatch)
    log = ipywidgets.Output()
    with quiet(log):
        runner.say("the plan:\n  storage 7 s", pd.DataFrame({"step": ["storage"], "s": [7.0]}))
        with bar(total=3, desc="diag run") as outer:
            for _ in bar(range(2), desc="storage", leave=False):  # closes its widget
                pass
            outer.update(3)
        runner.say("step 2: stage shares so far: compute 90%")
        shown = [o["data"] for o in log.outputs]
        assert not any("storage:" in d["text/plain"] for d in shown)  # the closed bar is gone
    texts = [o["data"]["text/plain"] for o in log.outputs]
    assert all(runner.VIEW not in o["data"] for o in log.outputs)  # no widget a reload loses
    assert texts[0] == "the plan:\n  storage 7 s"
    assert "<table" in log.outputs[0]["data"]["text/html"]
    assert texts[1].startswith("diag run: 100%") and "3/3" in texts[1]
    assert texts[2] == "step 2: stage shares so far: compute 90%"
    # only bars made inside the block went to the log; after it, tqdm's display is its own
    import tqdm.notebook

    assert tqdm.notebook.display.__module__ != "diag.runner"


def test_a_block_whose_bars_all_closed_keeps_the_last_ones_line(monkeypatch):
    import ipywidgets

    bar = _kernel_bars(monkeypatch)
    log = ipywidgets.Output()
    with quiet(log):
        for desc in ("accum sweep", "qlora plans x rounds"):
            for _ in bar(range(2), desc=desc, leave=False):
                pass
    assert [o["data"]["text/plain"][:22] for o in log.outputs] == ["qlora plans x rounds: "]
