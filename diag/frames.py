"""A runner's result as named frames: the tables the CLI shows and the CSVs a run folder holds.

A dataclass's first frame is named `name`, the others `<name>_<field>` (`advice` as is); a
StageTimer frame goes under `run`, decisions under `decisions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import pandas as pd

from diag.decision import Decision, frame
from diag.timing import STAGE_FRAME, is_stage_frame


def frames_of(name: str, result: Any) -> dict[str, pd.DataFrame]:
    """result's frames by name, in its fields' order (None fields and non-frames left out)."""
    key = name.replace("-", "_")
    if isinstance(result, pd.DataFrame):
        fields = [("frame", result)]
    elif dataclasses.is_dataclass(result):
        fields = [(f.name, getattr(result, f.name)) for f in dataclasses.fields(result)]
    else:
        raise TypeError(f"{name}: a runner returns a DataFrame or a dataclass of frames, "
                        f"not {type(result).__name__}")
    out = {}
    for i, (field, value) in enumerate(fields):
        if isinstance(value, tuple) and value and all(isinstance(d, Decision) for d in value):
            out["decisions"] = frame(value)  # one key whichever experiment decided
        elif isinstance(value, pd.DataFrame) and is_stage_frame(value):
            # under one key, whichever command wrote it (`run` names the run, e.g. `toy`)
            out[STAGE_FRAME] = value if "run" in value.columns else value.assign(run=key)
        elif isinstance(value, pd.DataFrame):
            out[key if i == 0 else field if field == "advice" else f"{key}_{field}"] = value
    return out


def folder_frames(results: Iterable[tuple[str, Any]]) -> dict[str, pd.DataFrame]:
    """Several named results as a run folder holds them, every decision in `decisions`."""
    out: dict[str, pd.DataFrame] = {}
    decided: list[Decision] = []
    for name, result in results:
        decided += getattr(result, "decisions", ())
        for key, got in frames_of(name, result).items():
            if key in ("advice", "decisions") or got.empty:
                continue
            # every run's stage rows in the one `run` frame
            out[key] = pd.concat([out[key], got], ignore_index=True) \
                if key == STAGE_FRAME and key in out else got
    if decided:
        out["decisions"] = frame(decided)
    return out
