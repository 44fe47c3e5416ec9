"""Where a run's wall clock goes, and what an upgrade or a fix would buy (Amdahl's law).

Input: StageTimer frames; step-level stages are scaled to the whole run (mean x steps); a
speedup k divides a stage's seconds by k (inf removes it), the others set the floor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from diag.decision import DATA_WAIT_GOAL, FIXES
from diag.timing import LOAD_PARTS, RUN_STAGES, STAGES, STEP_STAGES

GPU_BOUND = ("compute", "warmup")  # what a faster GPU shortens; the rest is floor
# no fix removes the work itself or the Trainer's set-up (paid once per start whatever the plan)
UNCHANGED = ("compute", "train", "setup")
DATA_WAIT_FLAG = 0.10  # data_wait's share of step time above which it is flagged (noted: GOAL)


def _check(frame: pd.DataFrame) -> pd.DataFrame:
    if not isinstance(frame, pd.DataFrame) or frame.empty:
        raise ValueError("frame is empty: pass a StageTimer frame with stage and seconds rows")
    missing = {"stage", "seconds"} - set(frame.columns)
    if missing:
        raise ValueError(f"frame lacks column(s) {sorted(missing)}: needs stage and seconds")
    unknown = sorted(set(frame["stage"]) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}: allowed stages are {', '.join(STAGES)}")
    negative = frame[frame["seconds"] < 0]
    if not negative.empty:
        row = negative.iloc[0]
        raise ValueError(f"negative duration {float(row['seconds'])} s for stage {row['stage']!r}: "
                         "durations must be >= 0")
    defaults = {"run": "run", "step": pd.NA}
    return frame.assign(**{k: v for k, v in defaults.items() if k not in frame.columns})


def _one_run(frame: pd.DataFrame, total_steps: int | None) -> list[dict[str, Any]]:
    """Seconds per stage of one rank's wall clock (ranks run side by side: their mean)."""
    ranks = int(frame["rank"].nunique()) if "rank" in frame.columns else 1
    frame = frame.assign(seconds=frame["seconds"] / ranks)
    rows = []
    is_step = frame["stage"].isin(STEP_STAGES)
    stepped = frame[is_step & frame["step"].notna()]
    unstepped = frame[is_step & frame["step"].isna()].groupby("stage")["seconds"].sum()
    measured_steps = int(stepped["step"].nunique())
    n = total_steps or measured_steps
    for stage in RUN_STAGES:
        if stage == "train" and measured_steps:
            continue  # shown as its step-level parts below
        part = frame[frame["stage"] == stage]
        if stage == "load_model" and part.empty:  # parts only: their sum is the load
            part = frame[frame["stage"].isin(LOAD_PARTS)]
        if not part.empty:  # a row measured elsewhere says so in its own `basis`
            said = part["basis"].dropna().tolist() if "basis" in part.columns else []
            seconds = float(part["seconds"].sum())
            rows.append({"stage": stage, "level": "run", "seconds": seconds, "basis": said[0]
                         if said else f"measured ({len(part)} interval{'s' * (len(part) != 1)})"})
    # sums, not medians, so a stall every 4th step counts; scaled to total_steps by the mean
    sums = stepped.groupby("stage")["seconds"].sum()
    if measured_steps:
        train = float(frame.loc[frame["stage"] == "train", "seconds"].sum())
        # loop time inside train that no step stage covers is per-step overhead: "other"
        residual = max(train - float(stepped["seconds"].sum()), 0.0)
        sums = sums.add(pd.Series({"other": residual}), fill_value=0.0)
    for stage in STEP_STAGES:
        if stage not in sums.index and stage not in unstepped.index:
            continue
        measured = float(sums.get(stage, 0.0))
        mean = measured / measured_steps if measured_steps else 0.0
        if n == measured_steps:
            seconds, basis = measured, f"measured: {measured_steps} steps, mean {mean:.4g} s/step"
        else:
            seconds = mean * n
            basis = f"projected: mean {mean:.4g} s/step x {n} steps ({measured_steps} measured)"
        if stage in unstepped.index:  # timed outside watch(): summed as measured, not scaled
            seconds += float(unstepped[stage])
            basis += f"; {unstepped[stage]:.4g} s without step numbers, summed"
        rows.append({"stage": stage, "level": "step", "seconds": seconds, "basis": basis})
    if ranks > 1:
        rows = [{**r, "basis": f"{r['basis']}; mean of {ranks} ranks"} for r in rows]
    # what a fix can remove: a stage's seconds; of the warm-up, its start-up (less steady steps)
    warm = int((frame["stage"] == "warmup").sum()) // ranks
    steady = sum(r["seconds"] for r in rows if r["level"] == "step") / n if n else 0.0
    for r in rows:
        r["fixable_s"], r["fixable"] = r["seconds"], r["basis"]
        if r["stage"] == "warmup":
            start_up = r["seconds"] - warm * steady
            r["fixable_s"], r["fixable"] = (start_up, (
                f"less {warm} steady step{'s' * (warm != 1)} of {steady:.4g} s (the mean of "
                f"{measured_steps} measured): {start_up:.4g} s of start-up")) \
                if warm and measured_steps else (0.0, "")
    return rows


def shares(frame: pd.DataFrame, total_steps: int | None = None, fixable: bool = False
           ) -> pd.DataFrame:
    """Seconds and share per stage and `run`, steps scaled to total_steps (fixable: + fixable_s)."""
    if total_steps is not None and (isinstance(total_steps, bool) or total_steps <= 0):
        raise ValueError(f"total_steps={total_steps!r}: must be a whole number > 0")
    frame = _check(frame)
    out = []
    for run, part in frame.groupby("run", sort=False):
        rows = _one_run(part, total_steps)
        total = sum(r["seconds"] for r in rows)
        out += [{"run": run, **r, "share": r["seconds"] / total if total else 0.0} for r in rows]
    table = pd.DataFrame(out, columns=["run", "stage", "level", "seconds", "share", "basis",
                                       "fixable_s", "fixable"])
    return table if fixable else table.drop(columns=["fixable_s", "fixable"])


def project(frame: pd.DataFrame, speedup: Mapping[str, float],
            total_steps: int | None = None) -> pd.DataFrame:
    """Per run, each stage's seconds before and after `speedup`, and a `total` row."""
    for stage, k in speedup.items():
        if stage not in STAGES:
            raise ValueError(f"speedup for unknown stage {stage!r}: allowed stages are "
                             f"{', '.join(RUN_STAGES + STEP_STAGES)}")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or math.isnan(k) or k <= 0:
            raise ValueError(f"speedup[{stage!r}]={k!r}: must be a number > 0 "
                             "(float('inf') removes the stage)")
    table = shares(frame, total_steps)
    table["speedup"] = table["stage"].map(lambda s: float(speedup.get(s, 1.0)))
    table["seconds_after"] = table["seconds"] / table["speedup"]  # k = inf gives 0 s
    table = table.rename(columns={"seconds": "seconds_before"})
    totals = (table.groupby("run", sort=False)[["seconds_before", "seconds_after"]].sum()
              .reset_index().assign(stage="total", level="total", share=1.0, basis="sum"))
    totals["speedup"] = totals["seconds_before"] / totals["seconds_after"].where(
        totals["seconds_after"] > 0)
    cols = ["run", "stage", "level", "seconds_before", "speedup", "seconds_after", "share", "basis"]
    return pd.concat([table[cols], totals[cols]], ignore_index=True)


def compute_ratio(from_device: str, to_device: str, dtype: str = "bf16") -> float:
    """to_device's dense peak over from_device's (diag.machine.device); unknown: ValueError."""
    from diag.machine.device import GPUS, dense_peak_flops, find_gpu

    for name in (from_device, to_device):
        if dense_peak_flops(name, dtype) is None:
            known = ", ".join(g.name for g in GPUS)
            what = "unknown GPU" if find_gpu(name) is None else f"no dense {dtype} figure for"
            raise ValueError(f"{what} {name!r}: allowed devices are {known}")
    return dense_peak_flops(to_device, dtype) / dense_peak_flops(from_device, dtype)


def upgrade(frame: pd.DataFrame, from_device: str, to_device: str, dtype: str = "bf16",
            total_steps: int | None = None) -> pd.DataFrame:
    """project() with GPU_BOUND stages sped up by the dense peaks' ratio (an `assumption`)."""
    ratio = compute_ratio(from_device, to_device, dtype)
    table = project(frame, {stage: ratio for stage in GPU_BOUND}, total_steps)
    table["assumption"] = (f"{' and '.join(GPU_BOUND)} scale with the dense {dtype} peak ratio "
                           f"{to_device}/{from_device} = {ratio:.2f}x; the other stages do not "
                           "change with the GPU")
    return table


def infer_compute_share(t_before: float, t_after: float,
                        compute_speedup: float) -> dict[str, float]:
    """Inverse Amdahl: t_before = C + N, t_after = C/k + N: C = (t_before - t_after) / (1 - 1/k)."""
    for name, value in (("t_before", t_before), ("t_after", t_after)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r}: must be a duration > 0")
    if not isinstance(compute_speedup, (int, float)) or not compute_speedup > 1:
        raise ValueError(f"compute_speedup={compute_speedup!r}: must be > 1 (the new GPU is "
                         "faster)")
    if t_after > t_before:
        raise ValueError(f"t_after={t_after!r} > t_before={t_before!r}: a faster GPU cannot "
                         "make the run slower under Amdahl's law; check the two times")
    compute = (t_before - t_after) / (1 - 1 / compute_speedup)
    if compute > t_before:
        raise ValueError(f"t_after={t_after!r} is below t_before / compute_speedup = "
                         f"{t_before / compute_speedup:.4g}: faster than the compute ratio allows")
    return {"compute": compute, "not_compute": t_before - compute,
            "compute_share": compute / t_before, "not_compute_share": 1 - compute / t_before,
            "compute_after": compute / compute_speedup, "t_after": t_after}


def findings(frame: pd.DataFrame, advice: pd.DataFrame | None = None,
             total_steps: int | None = None, min_share: float = 0.01) -> pd.DataFrame:
    """Fixes ranked by seconds saved, with `advice` rows capped at their stage's seconds."""
    table = shares(frame, total_steps, fixable=True)
    runs = list(dict.fromkeys(table["run"]))
    extra = advice if advice is not None else pd.DataFrame(columns=["stage"])
    if "run" not in extra.columns:
        extra = extra.assign(run=runs[0])  # the experiments measured the first run
    specific = set(zip(extra["run"], extra["stage"]))
    rows = []
    for run, part in table.groupby("run", sort=False):
        step_total = part.loc[part["level"] == "step", "seconds"].sum()
        total = part["seconds"].sum()
        for r in part.itertuples():
            seconds, basis = r.fixable_s, r.fixable
            # a stage an experiment measured a fix for gets that fix, not the generic one
            if r.stage in UNCHANGED or seconds <= 0 or (run, r.stage) in specific:
                continue
            wait, ratio = r.stage == "data_wait", r.seconds / step_total if step_total else 0.0
            if ratio <= DATA_WAIT_GOAL if wait else seconds < min_share * total:
                continue  # data_wait: its own thresholds, on its share of step time
            severity = ("flag" if ratio > DATA_WAIT_FLAG else "note") if wait else "fix"
            rows.append({"run": run, "stage": r.stage, "finding": FIXES[r.stage],
                         "seconds_saved": seconds, "share_of_run": seconds / total,
                         "severity": severity, "evidence": f"{r.stage}: {r.seconds:.4g} s, "
                         f"{r.share:.1%} of the run; {basis}"})
    totals = table.groupby("run")["seconds"].sum()
    fixable = table.set_index(["run", "stage"])["fixable_s"]
    for r in extra.itertuples():
        total = totals.get(r.run, float("nan"))
        saved, evidence = float(r.seconds_saved), r.evidence
        cap = fixable.get((r.run, r.stage), 0.0 if r.stage == "warmup" else None)
        if cap is not None and saved > cap:  # no fix saves more than the stage took in this run
            saved, evidence = float(cap), f"{evidence} (capped at the run's {r.stage}: {cap:.4g} s)"
        rows.append({"run": r.run, "stage": r.stage, "finding": r.finding, "seconds_saved": saved,
                     "share_of_run": saved / total if total else float("nan"),
                     "severity": "fix", "evidence": evidence})
    cols = ["rank", "run", "stage", "finding", "seconds_saved", "share_of_run", "severity",
            "evidence"]
    if not rows:
        return pd.DataFrame(columns=cols)
    order = {run: i for i, run in enumerate(runs)}  # runs in their order, then most saved first
    out = pd.DataFrame(rows).sort_values(["run", "seconds_saved"], ascending=[True, False], key=(
        lambda c: c.map(order).fillna(len(order)) if c.name == "run" else c))
    out["rank"] = out.groupby("run", sort=False).cumcount() + 1
    return out[cols].reset_index(drop=True)


# the verdict's groups of stages, the one rule every view reads; checkpoint, eval, other: none
BOUND = {"input-bound": ("data_wait", "h2d"),
         "start-up-bound": ("fetch_data", "load_model", "preprocess", "setup", "warmup"),
         "communication-bound": ("comm_wait",),
         "compute-bound": ("compute",)}
SAYS = {"input-bound": "waiting for input (data_wait, h2d)",
        "start-up-bound": "starting (fetch, model load, preprocess, set-up, warm-up)",
        "communication-bound": "waiting on other ranks (comm_wait)",
        "compute-bound": "computing",
        "memory-bound": "computing at a micro-batch memory capped"}


def verdict(table: pd.DataFrame, run: str | None = None, memory_capped: bool = False
            ) -> dict[str, Any]:
    """{"verdict", "share", "text"} of one run (None: the first): its largest BOUND group."""
    part = table[table["run"] == (run if run is not None else table["run"].iloc[0])]
    by = {k: float(part.loc[part["stage"].isin(v), "share"].sum()) for k, v in BOUND.items()}
    kind = max(by, key=by.get)
    share = by[kind]
    if kind == "compute-bound" and memory_capped:
        kind = "memory-bound"
    return {"verdict": kind, "share": share,
            "text": f"{kind}: {share:.0%} of the run is spent {SAYS[kind]}"}
