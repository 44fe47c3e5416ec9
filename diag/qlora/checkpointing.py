"""Gradient checkpointing on vs off, timed on the QLoRA job's own step, and the decision.

diag.qlora.measure.checkpointing_on_job runs the job's step (QLoraStep: nf4 base + LoRA, forward,
backward, AdamW) with checkpointing on and off, alternating step by step after one warm-up each,
one row per timed step (COLUMNS): seconds and the step's own peak memory (CUDA max allocated over
what was allocated before; on CPU the resident set's growth during the step, not the
interpreter's). `decide(frame, device)` turns it off when the peak without it stays under
CHECKPOINTING_HEADROOM of the memory it lives in (else on); the on/off seconds price the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diag.decision import CHECKPOINTING_HEADROOM, Decision, MeasuredOn

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = ["gradient_checkpointing", "micro_batch", "seq_len", "seconds", "peak_mem_gb", "repeat"]


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
           memory: tuple[float, str] | None = None, naive_micro_batch: int | None = None
           ) -> tuple[Decision, ...]:
    """`gradient_checkpointing` from the on/off rows; absent or failed: on for CUDA (the safe
    default), off on CPU (activations only grow host RAM), labelled default. The rows at
    `naive_micro_batch` give its `naive_ratio` (on/off seconds a naive step pays)."""
    cuda = str(device).startswith("cuda")
    usable = frame is not None and not frame.empty and {True, False} <= set(
        frame["gradient_checkpointing"].astype(bool))
    if not usable:
        why = ("checkpointing frame absent" if frame is None or frame.empty else
               "checkpointing was not timed both on and off")
        return (Decision.default("gradient_checkpointing", cuda,
                                 f"{why}: " + ("on, the safe default on CUDA" if cuda else
                                               "off, on CPU activations live in host RAM"),
                                 source="checkpointing"),)
    # decided at the plan's micro-batch, the largest timed; the naive micro-batch's on/off
    # ratio prices the naive step's checkpointing (diag.qlora.predict)
    sized = "micro_batch" in frame.columns
    top = frame[frame["micro_batch"] == frame["micro_batch"].max()] if sized else frame
    on_s, off_s = _medians(top)
    naive_on, naive_off = _medians(frame[frame["micro_batch"] == naive_micro_batch] if sized
                                   else frame.iloc[:0])
    peak = float(top.loc[~top["gradient_checkpointing"].astype(bool), "peak_mem_gb"].max())
    total, where = memory or memory_gb(device)
    # recomputing activations never makes a step faster, it only saves memory: off wherever
    # the step's peak without it fits; the timings are what that is worth (noisy on a shared
    # machine, so they price the choice and do not make it). An unreadable peak: no evidence.
    choice = not (not math.isnan(peak) and peak <= CHECKPOINTING_HEADROOM * total)
    why = (f"on {on_s:.3g} s vs off {off_s:.3g} s per step; the step's peak without it "
           f"{peak:.3g} GB of {total:.3g} GB {where} (limit {CHECKPOINTING_HEADROOM:.0%}) -> "
           f"{'on' if choice else 'off'}")
    return (Decision.from_rows("gradient_checkpointing", choice, why, frame,
                               source="checkpointing", measured_on=measured_on, baseline=True,
                               stage="compute", per="step", baseline_s=on_s,
                               chosen_s=on_s if choice else off_s,
                               naive_ratio=naive_on / naive_off if naive_off > 0 else None),)


def _medians(rows: pd.DataFrame) -> tuple[float, float]:
    """Median step seconds with checkpointing on and off (NaN where a side has no row)."""
    flag = rows["gradient_checkpointing"].astype(bool)
    return tuple(float(rows.loc[flag == v, "seconds"].median()) for v in (True, False))
