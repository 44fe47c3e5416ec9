"""Gradient checkpointing on vs off, timed on the QLoRA job's own step (measure.py), and the
decision: off where the peak without it fits CHECKPOINTING_HEADROOM and off resolves faster."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diag.decision import CHECKPOINTING_HEADROOM, Decision, MeasuredOn
from diag.noise import clock, compare, spread

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = ["gradient_checkpointing", "micro_batch", "seq_len", "seconds", "cpu_s", "peak_mem_gb",
           "repeat"]


@dataclass(frozen=True)
class CheckpointingResult:
    """On vs off on the job's step (first field: the main table) and the decision."""

    frame: pd.DataFrame  # one row per timed step (COLUMNS)
    decisions: tuple[Decision, ...]  # gradient_checkpointing


def memory_gb(device: str) -> tuple[float, str]:
    """Memory the step's activations live in: the device's, or on CPU the host's available."""
    if str(device).startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory / 1e9
        return total, "device memory"
    import psutil

    return psutil.virtual_memory().available / 1e9, "available host memory"  # what it can grow into


def decide(frame: pd.DataFrame | None, device: str = "cpu", measured_on: MeasuredOn | None = None,
           memory: tuple[float, str] | None = None, naive_micro_batch: int | None = None,
           repeats_s: float | None = None) -> tuple[Decision, ...]:
    """`gradient_checkpointing` from the on/off rows at the top micro-batch, else the default."""
    cuda = str(device).startswith("cuda")
    fallback = ("on, the safe default on CUDA" if cuda else
                "off, on CPU activations live in host RAM")

    def default(why: str) -> tuple[Decision, ...]:
        return (Decision.default("gradient_checkpointing", cuda, f"{why}{fallback}",
                                 source="checkpointing"),)

    if frame is None or frame.empty:
        return default("checkpointing frame absent: ")
    if not {True, False} <= set(frame["gradient_checkpointing"].astype(bool)):
        return default("checkpointing was not timed both on and off: ")
    sized = "micro_batch" in frame.columns
    top = frame[frame["micro_batch"] == frame["micro_batch"].max()] if sized else frame
    timed_on = clock(device)
    column, unit = timed_on.col(), timed_on.unit
    on, off = _sides(top, column)
    if min(statistics.median(on), statistics.median(off)) <= 0:  # no timing: no evidence
        return default("a checkpointing side took no time: ")
    gap = compare(on, off)
    if gap.faster == "a":
        return default(f"on measured faster than off ({gap.describe()}) after re-measuring, "
                       "which recomputing cannot be: no timing prices it; ")
    peak = float(top.loc[~top["gradient_checkpointing"].astype(bool), "peak_mem_gb"].max())
    total, where = memory or memory_gb(device)
    fits = not math.isnan(peak) and peak <= CHECKPOINTING_HEADROOM * total  # NaN: no evidence
    choice = not (fits and gap.resolved)
    on_s, off_s = map(statistics.median, (on, off))
    ratio, note = _naive_ratio(frame[frame["micro_batch"] == naive_micro_batch] if sized
                               else frame.iloc[:0], naive_micro_batch, column)
    why = (f"on {on_s:.3g} {unit} vs off {off_s:.3g} {unit} per step: {gap.describe()}; the "
           f"step's peak without it {peak:.3g} GB of {total:.3g} GB {where} (limit "
           f"{CHECKPOINTING_HEADROOM:.0%}) -> {'on' if choice else 'off'}"
           + (" (the naive plan's, kept)" if fits and choice else "") + note
           + (f"; {repeats_s:.2g} s re-timing" if repeats_s else "") + f"; compared on {timed_on}")
    return (Decision.from_rows("gradient_checkpointing", choice, why, frame,
                               source="checkpointing", measured_on=measured_on, baseline=True,
                               stage="compute", per="step", clock=timed_on.name, baseline_s=on_s,
                               chosen_s=on_s if choice else off_s, naive_ratio=ratio,
                               samples=(len(on), len(off)), spread=(spread(on), spread(off)),
                               resolved=gap.resolved, repeats_s=repeats_s),)


def _naive_ratio(naive: pd.DataFrame, micro: int | None, column: str) -> tuple[float | None, str]:
    """On/off at the naive micro-batch (1.0 within noise, None without evidence), and a note."""
    if not {True, False} <= set(naive["gradient_checkpointing"].astype(bool)):
        return None, ""
    on, off = _sides(naive, column)
    at = compare(on, off) if min(statistics.median(on), statistics.median(off)) > 0 else None
    ratio = (None if at is None or at.faster == "a" else
             statistics.median(on) / statistics.median(off) if at.resolved else 1.0)
    return ratio, (f"; at the naive micro-batch {micro}: "
                   + (at.describe() if at else "a side took no time")
                   + (", no ratio priced" if ratio is None else ""))


def pending(samples: dict[tuple[int, int, int], list[float]]) -> list[tuple[int, int, int]]:
    """The (step, micro_batch, 1) keys to re-time (step 0: on): a gap open, or on faster."""
    out = []
    for micro in sorted({m for _, m, _ in samples}):
        on, off = samples.get((0, micro, 1)), samples.get((1, micro, 1))
        if on and off:
            gap = compare(on, off)
            if not gap.resolved or gap.faster == "a":
                out += [(0, micro, 1), (1, micro, 1)]
    return out


def _sides(rows: pd.DataFrame, column: str) -> tuple[list[float], list[float]]:
    flag = rows["gradient_checkpointing"].astype(bool)
    return list(rows.loc[flag, column]), list(rows.loc[~flag, column])
