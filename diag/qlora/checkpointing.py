"""Gradient checkpointing on vs off, timed on the QLoRA job's own step, and the decision.

diag.qlora.measure.checkpointing_on_job times the job's step with checkpointing on and off in
interleaved rounds (COLUMNS: wall and CPU seconds, the step's own peak memory); `decide` turns it
off where the peak without it fits CHECKPOINTING_HEADROOM of its memory and off resolves faster.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diag.decision import CHECKPOINTING_HEADROOM, Decision, MeasuredOn

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
    with open("/proc/meminfo") as f:  # MemAvailable: what this process can still grow into
        info = {line.split(":")[0]: line.split()[1] for line in f}
    return int(info["MemAvailable"]) / 1e6, "available host memory"


def decide(frame: pd.DataFrame | None, device: str = "cpu", measured_on: MeasuredOn | None = None,
           memory: tuple[float, str] | None = None, naive_micro_batch: int | None = None,
           repeats_s: float | None = None) -> tuple[Decision, ...]:
    """`gradient_checkpointing` from the on/off rows; absent or failed: on for CUDA (the safe
    default), off on CPU (activations only grow host RAM), labelled default. Off only where the
    step's peak without it fits (CHECKPOINTING_HEADROOM) and off is resolved faster
    (diag.noise); within noise the naive plan's on is kept. On resolved faster than off
    cannot be (recomputing adds work): after re-measuring (`pending`), the default, said so,
    and no ratio is priced. `naive_ratio`: on/off seconds at `naive_micro_batch` where resolved
    (1.0 within noise). Compared on `device`'s clock (step_clock), priced in wall seconds
    (naive_ratio on the clock compared)."""
    from diag.noise import clock, compare, spread

    cuda = str(device).startswith("cuda")
    fallback = ("on, the safe default on CUDA" if cuda else
                "off, on CPU activations live in host RAM")
    usable = frame is not None and not frame.empty and {True, False} <= set(
        frame["gradient_checkpointing"].astype(bool))
    if not usable:
        why = ("checkpointing frame absent" if frame is None or frame.empty else
               "checkpointing was not timed both on and off")
        return (Decision.default("gradient_checkpointing", cuda, f"{why}: {fallback}",
                                 source="checkpointing"),)
    # decided at the plan's micro-batch, the largest timed; the naive micro-batch's on/off
    # ratio prices the naive step's checkpointing
    sized = "micro_batch" in frame.columns
    top = frame[frame["micro_batch"] == frame["micro_batch"].max()] if sized else frame
    timed_on = clock(device)
    column, unit = timed_on.col(), timed_on.unit
    on, off = _sides(top, column)
    if min(statistics.median(on), statistics.median(off)) <= 0:  # no timing: no evidence
        return (Decision.default("gradient_checkpointing", cuda, "a checkpointing side took "
                                 f"no time: {fallback}", source="checkpointing"),)
    gap = compare(on, off)
    if gap.faster == "a":
        return (Decision.default("gradient_checkpointing", cuda, (
            f"on measured faster than off ({gap.describe()}) after re-measuring, which "
            f"recomputing cannot be: no timing prices it; {fallback}"), source="checkpointing"),)
    peak = float(top.loc[~top["gradient_checkpointing"].astype(bool), "peak_mem_gb"].max())
    total, where = memory or memory_gb(device)
    # recomputing activations never makes a step faster, it only saves memory: off where the
    # step's peak without it fits and the time it saves is real; an unreadable peak: no evidence
    fits = not math.isnan(peak) and peak <= CHECKPOINTING_HEADROOM * total
    choice = not (fits and gap.resolved)
    why = (f"on {statistics.median(on):.3g} {unit} vs off {statistics.median(off):.3g} {unit} "
           f"per step: {gap.describe()}; the step's peak without it {peak:.3g} GB of "
           f"{total:.3g} GB {where} (limit "
           f"{CHECKPOINTING_HEADROOM:.0%}) -> {'on' if choice else 'off'}"
           + (" (the naive plan's, kept)" if fits and choice else ""))
    ratio, note = _naive_ratio(frame[frame["micro_batch"] == naive_micro_batch] if sized
                               else frame.iloc[:0], naive_micro_batch, column)
    why += note + (f"; {repeats_s:.2g} s re-timing" if repeats_s else "") + \
        f"; compared on {timed_on}"
    on_s, off_s = map(statistics.median, (on, off))
    return (Decision.from_rows("gradient_checkpointing", choice, why, frame,
                               source="checkpointing", measured_on=measured_on, baseline=True,
                               stage="compute", per="step", clock=timed_on.name, baseline_s=on_s,
                               chosen_s=on_s if choice else off_s, naive_ratio=ratio,
                               samples=(len(on), len(off)), spread=(spread(on), spread(off)),
                               resolved=gap.resolved, repeats_s=repeats_s),)


def _naive_ratio(naive: pd.DataFrame, micro: int | None, column: str = "seconds"
                 ) -> tuple[float | None, str]:
    """On/off seconds on `column` (the clock compared) at the naive micro-batch where their gap
    resolved (1.0 within noise; None where a side is missing, took no time or was the
    impossible one), and the why's note."""
    from diag.noise import compare

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
    """The (step, micro_batch, 1) keys to re-time (step 0: on, 1: off): at each micro-batch a
    gap not yet resolved, or resolved the impossible way (on faster)."""
    from diag.noise import compare

    out = []
    for micro in sorted({m for _, m, _ in samples}):
        on, off = samples.get((0, micro, 1)), samples.get((1, micro, 1))
        if on and off:
            gap = compare(on, off)
            if not gap.resolved or gap.faster == "a":
                out += [(0, micro, 1), (1, micro, 1)]
    return out


def _sides(rows: pd.DataFrame, column: str = "seconds") -> tuple[list[float], list[float]]:
    """`column` (a clock: wall seconds, or cpu_s) of the steps with checkpointing on, and off."""
    flag = rows["gradient_checkpointing"].astype(bool)
    return list(rows.loc[flag, column]), list(rows.loc[~flag, column])
