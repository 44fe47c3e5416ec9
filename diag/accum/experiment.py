"""`run_accum(cfg)`: the sweep, one summary row per point, the MFU cross-check and the advice;
`decide` takes the fastest point whose gap to the naive micro-batch resolves, else keeps it.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import pandas as pd

from diag.accum.model import Setup, measure
from diag.config import AccumConfig
from diag.decision import Decision, MeasuredOn
from diag.machine.device import on_cpu_threads
from diag.mfu import disagreement, floor_impossible
from diag.noise import Choice, choose, clock, compare, spread
from diag.timing import stragglers
from diag.timing.harness import ranks_first

DEFAULT_MICRO_BATCH = 8  # no sweep ran: fits the tiny and the 1B model on any 16 GB GPU


@dataclass(frozen=True)
class AccumResult:
    """What `run_accum` returns; under a launcher `frame` holds every rank's steps."""

    frame: pd.DataFrame  # one row per timed optimizer step per point (sweep.COLUMNS)
    summary: pd.DataFrame  # one row per point: medians, floor, warm-up, recommended
    mfu: pd.DataFrame  # formula vs FlopCounterMode, and the peak MFU is computed against
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence
    decisions: tuple[Decision, ...] = ()  # micro_batch: the fastest point where it resolves
    ranks: pd.DataFrame | None = None  # under DDP: per point and rank, each stage's median step
    stages: pd.DataFrame | None = None  # under DDP: every rank's timed steps (`run`: the point)


@on_cpu_threads
def run_accum(cfg: AccumConfig | None = None) -> AccumResult:
    """The sweep at cfg's tokens per step, then its summary, MFU cross-check and advice."""
    cfg = cfg or AccumConfig.default()
    frame, setup, ddp = measure(cfg)
    every, stages = ddp.gathered(frame) if ddp else (ranks_first(frame), None)
    # ranks run in lockstep, so theirs are not independent samples: this rank's steps decide
    frame = every[every["rank"] == (ddp.timer.rank if ddp else 0)]
    summary = summarize(frame, device=setup.device)
    on = MeasuredOn(model=f"{cfg.model} ({setup.shape.params / 1e6:.3g}M params)",
                    precision=setup.amp, seq_len=cfg.seq_len,
                    step=f"{cfg.tokens_per_step:,} tokens per optimizer step",
                    device=setup.device, tokens_per_step=cfg.tokens_per_step)
    return AccumResult(every, summary, mfu_check(setup), advice(summary, cfg.steps_per_run),
                       decide(frame, on), None if stages is None else stragglers.per_rank(stages),
                       stages)


def decide(frame: pd.DataFrame | None, measured_on: MeasuredOn | None = None,
           baseline: int = 1, repeats_s: float | None = None) -> tuple[Decision, ...]:
    """`micro_batch`: the point `settle` takes on the device's clock; none ran: the default."""
    ok = frame[frame["status"] == "ok"] if frame is not None and not frame.empty else None
    if ok is None or ok.empty:
        why = ("accum frame absent" if frame is None or frame.empty else
               "no accum point ran (" + ", ".join(sorted(set(frame["status"]))) + ")")
        return (Decision.default("micro_batch", DEFAULT_MICRO_BATCH, f"{why}: micro-batch "
                                 f"{DEFAULT_MICRO_BATCH}", source="accum"),)
    on = clock(measured_on.device if measured_on else "")
    column, unit = on.col("seconds_per_step"), on.unit
    times, ref, pick = settle(ok, column, baseline)
    med = {m: statistics.median(t) for m, t in times.items()}
    accum = {int(m): int(a) for m, a in zip(ok["micro_batch"], ok["grad_accum"])}
    micro, gap = pick.value, pick.against
    settled = micro not in (ref, pick.best)  # settle() took a tied point over the fastest
    kept = "the naive plan's" if ref == baseline else "the most accumulation swept"

    def point(m: int) -> str:
        return f"micro-batch {m} x {accum[m]} ({med[m]:.3g} {unit} per step)"

    if gap is None:
        why = (f"{point(micro)}, the only point that ran ({len(times[micro])} samples, spread "
               f"{spread(times[micro]):.0%})")
    elif settled:
        why = (f"{point(micro)} against {point(ref)}: {gap.describe()}; within noise of the "
               f"fastest, {point(pick.best)}: the least accumulation of them (the Trainer pays "
               "per micro-batch what this step does not time)")
    elif pick.best != ref:
        why = (f"{point(pick.best)}, the fastest of {len(times)} points, against "
               f"{point(ref)}: {gap.describe()}"
               + ("" if micro != ref else f"; micro-batch {ref} kept ({kept})"))
    else:
        why = (f"{point(ref)} ({kept}) is the fastest of {len(times)} points, against "
               f"{point(pick.rival)}: {gap.describe()}")
    tied = tuple(m for m in (pick.best, *pick.tied) if m != micro) if settled else pick.tied
    if tied and micro != ref:
        why += "; within noise of the fastest: " + ", ".join(f"micro-batch {m}" for m in tied)
    if repeats_s:
        why += f"; {repeats_s:.2g} s re-timing the finalists"
    why += f"; compared on {on}"
    sides = [micro] if gap is None else [micro, ref if micro != ref else pick.best]
    return (Decision.from_rows(
        "micro_batch", micro, why, ok[ok["micro_batch"].isin({micro, ref, pick.best})],
        source="accum", measured_on=measured_on, baseline=baseline, stage="compute",
        per="step", clock=on.name, baseline_s=med.get(baseline), chosen_s=med[micro],
        naive_ratio=med[baseline] / med[micro] if baseline in med else None,
        samples=tuple(len(times[m]) for m in sides), spread=tuple(spread(times[m]) for m in sides),
        tied=tied, resolved=pick.resolved, repeats_s=repeats_s),)


def settle(ok: pd.DataFrame, column: str, baseline: int
           ) -> tuple[dict[int, list[float]], int, Choice]:
    """(samples by micro-batch, the reference, diag.noise.choose's pick against it); among ties,
    the largest that resolved faster than the reference (docs/calibration.md)."""
    times = {int(m): list(g[column]) for m, g in ok.groupby("micro_batch")}
    ref = baseline if baseline in times else min(times)
    pick = choose(times, ref)
    if pick.value == ref or not pick.tied:
        return times, ref, pick
    wins = {m: compare(times[m], times[ref]) for m in (pick.value, *pick.tied) if m != ref}
    largest = max(m for m, gap in wins.items() if gap.faster == "a")
    return times, ref, dataclasses.replace(pick, value=largest, against=wins[largest])


def summarize(frame: pd.DataFrame, baseline: int = 1, device: str = "") -> pd.DataFrame:
    """Per point: medians, floor, memory; `recommended` on the point `decide` takes."""
    keys = ["micro_batch", "grad_accum", "tokens_per_step", "status"]
    first = {"floor_s": "first", "peak_mem_gb": "max", "warmup_s": "first", "compile": "first",
             "detail": "first"}
    medians = {c: "median" for c in ("seconds_per_step", "cpu_s", "tokens_per_s", "data_s",
                                     "comm_wait_s", "compute_s", "mfu") if c in frame.columns}
    out = frame.groupby(keys, sort=False, dropna=False).agg(
        {**medians, **first, "repeat": "count"}).reset_index().rename(columns={"repeat": "steps"})
    out.loc[out["status"] != "ok", "steps"] = 0
    ok = out[out["status"] == "ok"]
    out["vs_worst"] = out["tokens_per_s"] / ok["tokens_per_s"].min() if not ok.empty else math.nan
    out["recommended"] = False
    if not ok.empty:
        pick = settle(frame[frame["status"] == "ok"], clock(device).col("seconds_per_step"),
                      baseline)[2]
        out.loc[ok.index[ok["micro_batch"] == pick.value][0], "recommended"] = True
    out["floor_flagged"] = [floor_impossible(f, s) for f, s in
                            zip(out["floor_s"], out["seconds_per_step"])]
    cols = ["micro_batch", "grad_accum", "tokens_per_step", "status", "seconds_per_step",
            "cpu_s", "floor_s", "floor_flagged", "tokens_per_s", "vs_worst", "mfu", "peak_mem_gb",
            "data_s", "comm_wait_s", "compute_s", "warmup_s", "compile", "steps", "recommended",
            "detail"]
    return pd.DataFrame(out[[c for c in cols if c in out.columns]])


def mfu_check(setup: Setup) -> pd.DataFrame:
    """The formula's FLOPs per token beside FlopCounterMode's, and the peak used for MFU."""
    shape, peak, counted = setup.shape, setup.peak, setup.counted_per_token
    formula = shape.flops_per_token
    common = {"params": shape.params, "layers": shape.layers, "d_model": shape.d_model,
              "seq_len": shape.seq_len, "amp": setup.amp, "device": setup.device,
              "peak_tflops": peak.flops / 1e12 if peak.flops else math.nan,
              "peak": peak.label + (f" ({peak.source})" if peak.source and not peak.measured
                                    else "")}
    flagged, note = disagreement(formula, counted,
                                 "check N (tied or untied head), the attention term, and kernels "
                                 "the counter has no formula for")
    return pd.DataFrame([
        {"method": "formula 6N + 12·L·d·T", "flops_per_token": formula, "vs_formula": 1.0,
         "flagged": False, "note": "", **common},
        {"method": "FlopCounterMode, one micro-step", "flops_per_token": counted,
         "vs_formula": counted / formula, "flagged": flagged, "note": note, **common},
    ])


def advice(summary: pd.DataFrame, steps_per_run: int, compute_s: float | None = None
           ) -> pd.DataFrame:
    """The recommended point against the most-accumulating one, per steps_per_run or compute_s."""
    cols = ["stage", "finding", "seconds_saved", "evidence"]
    ok = summary[summary["status"] == "ok"]
    picked = ok[ok["recommended"].astype(bool)]
    worst = ok.loc[ok["grad_accum"].idxmax()] if len(ok) else None
    if len(ok) < 2 or picked.empty or picked.index[0] == worst.name:
        return pd.DataFrame(columns=cols)
    best = picked.iloc[0]
    largest = ok.loc[ok["micro_batch"].idxmax()]
    fraction = 1.0 - best["seconds_per_step"] / worst["seconds_per_step"]
    saved, over = ((worst["seconds_per_step"] - best["seconds_per_step"]) * steps_per_run,
                   f"over {steps_per_run:,} steps") if compute_s is None else (compute_s * fraction,
        f"{fraction:.0%} shorter steps applied to the run's compute ({compute_s:.3g} s)")
    ooms = summary[summary["status"] == "oom"]
    edge = (f"; micro-batch {int(ooms['micro_batch'].min())} ran out of memory"
            if not ooms.empty else "")
    note = ("" if best["micro_batch"] == largest["micro_batch"] else
            f"; the largest that fits ({int(largest['micro_batch'])}) was slower here")
    mfu = f", MFU {best['mfu']:.1%}" if best["mfu"] == best["mfu"] else ""
    evidence = (f"{int(best['micro_batch'])} x {int(best['grad_accum'])}: "
                f"{best['tokens_per_s']:,.0f} tokens/s, {best['seconds_per_step']:.3g} s/step{mfu}"
                f" vs {int(worst['micro_batch'])} x {int(worst['grad_accum'])}: "
                f"{worst['tokens_per_s']:,.0f} tokens/s "
                f"({best['tokens_per_s'] / worst['tokens_per_s']:.2f}x)"
                f" at {int(best['tokens_per_step']):,} tokens per step, medians, {over}{edge}"
                f"{note}; floor {best['floor_s']:.3g} s/step at 100% MFU")
    finding = (f"train with micro-batch {int(best['micro_batch'])} x grad_accum "
               f"{int(best['grad_accum'])}: the same tokens per step, fewer accumulation steps")
    return pd.DataFrame([{"stage": "compute", "finding": finding,
                          "seconds_saved": max(0.0, saved), "evidence": evidence}], columns=cols)
