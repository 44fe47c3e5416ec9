"""The runner every recipe step goes through: inside a step the libraries' own progress bars are
silent (diag's bar is the one shown), and after it they are as the user had them."""

from __future__ import annotations

import io
from dataclasses import dataclass

from tqdm.auto import tqdm

from diag.runner import Runner, Step


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
