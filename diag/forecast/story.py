"""What a naive vs optimized comparison says, read from the cost table and nothing else.

`check`: each stage's saving predicted before the runs beside the runs' own; `waterfall`: naive
total, each stage a fix changed, one residual, optimized total; `headline`: the ratio with its
rounds and interval, resolved or not. All on the comparison's clock (diag.noise.clock).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from diag.decision import PREDICTION_FLOOR_S, PREDICTION_TOLERANCE
from diag.forecast.costs import price, table
from diag.noise import MIN_SAMPLES, compare, median_interval

# the rule every predicted-vs-measured figure is judged by, said once wherever one is shown
TOLERANCE = (f"a prediction is flagged when it misses by more than {PREDICTION_TOLERANCE:.0%} of "
             f"itself, or of {PREDICTION_FLOOR_S / PREDICTION_TOLERANCE:.2g} s where it is "
             f"smaller (a miss under {PREDICTION_FLOOR_S:.2g} s never is)")
ORDER = ("fetch_data", "load_model", "preprocess", "setup", "warmup", "train", "checkpoint",
         "eval")


def judged(stage: str, finding: str, predicted: float | None, measured: float,
           evidence: str = "") -> dict[str, Any]:
    """One checked prediction: its error as a share of the prediction (TOLERANCE)."""
    err = None if predicted is None else abs(measured - predicted) / max(
        abs(predicted), PREDICTION_FLOOR_S / PREDICTION_TOLERANCE)
    return {"stage": stage, "finding": finding, "predicted_s": predicted, "measured_s": measured,
            "error_share": err,
            "flagged": bool(err is not None and err > PREDICTION_TOLERANCE), "evidence": evidence}


def check(before_priced: pd.DataFrame, runs_priced: pd.DataFrame, clock: str,
          fixes: Mapping[str, Sequence[str]]) -> pd.DataFrame:
    """Per run-level stage the saving (naive - optimized) predicted beside the runs' own."""
    before, runs = _by(before_priced), _by(runs_priced)
    rows = []
    for stage in ORDER:
        part = "download" if stage == "load_model" and ("download", "naive") in before else stage
        if (stage, "naive") not in runs and (stage, "optimized") not in runs:
            continue
        measured = _saving(runs, part)
        changed = list(fixes.get(stage, ()))
        if changed:
            predicted = _saving(before, part) if (part, "naive") in before and (
                part, "optimized") in before else None
            said = (f"predicted from what was timed before the runs: "
                    f"{_pair(before, part, clock)}" if predicted is not None else
                    "not predicted: nothing was timed before the runs for it")
        else:
            predicted, said = 0.0, "no setting of the plans changes it"
        what = "its model folder (the part the fix sets): " if part == "download" else ""
        rows.append(judged(stage, "; ".join(changed) or "unchanged", predicted, measured,
                           f"{said}; measured {what}{_pair(runs, part, clock)}")
                    | {"clock": clock})
    return pd.DataFrame(rows, columns=["stage", "finding", "predicted_s", "measured_s",
                                       "error_share", "flagged", "evidence", "clock"])


def _by(priced: pd.DataFrame) -> dict[tuple[str, str], float]:
    return {(s, p): v for p, s, v in zip(priced["plan"], priced["stage"], priced["seconds"])}


def _saving(by: Mapping[tuple[str, str], float], stage: str) -> float:
    return by.get((stage, "naive"), 0.0) - by.get((stage, "optimized"), 0.0)


def _pair(by: Mapping[tuple[str, str], float], stage: str, clock: str) -> str:
    unit = "CPU s" if clock == "CPU" else "s"
    return (f"naive {by.get((stage, 'naive'), 0.0):.3g} {unit} -> optimized "
            f"{by.get((stage, 'optimized'), 0.0):.3g} {unit}")


def waterfall(runs_priced: pd.DataFrame, clock: str, fixes: Mapping[str, Sequence[str]]
              ) -> pd.DataFrame:
    """Rows naive, one per stage a fix changed (its change), one residual, optimized."""
    runs = _by(runs_priced)
    stages = [s for s in ORDER if (s, "naive") in runs or (s, "optimized") in runs]
    total = {p: sum(runs.get((s, p), 0.0) for s in stages) for p in ("naive", "optimized")}
    change = {s: runs.get((s, "optimized"), 0.0) - runs.get((s, "naive"), 0.0) for s in stages}
    rest = [s for s in stages if not fixes.get(s)]
    bars = [(s, s, "; ".join(fixes[s]), change[s]) for s in stages if fixes.get(s)]
    if rest:
        bars.append(("unchanged", ", ".join(rest), "no fix changes these stages: the difference "
                     "is noise", sum(change[s] for s in rest)))
    flow = pd.DataFrame([("naive", "", "", 0.0), *bars, ("optimized", "", "", 0.0)],
                        columns=["bar", "stage", "fixes", "change"])
    # each bar stands where the changes before it and its own leave the naive total
    level = (total["naive"] + flow["change"].cumsum()).where(flow["bar"] != "optimized",
                                                             total["optimized"])
    return flow.assign(seconds=level, clock=clock)[["bar", "stage", "fixes", "seconds", "change",
                                                     "clock"]]


def headline(rounds: Mapping[str, Sequence[float]], tokens: Mapping[str, float], clock: str,
             totals: Mapping[str, float]) -> dict[str, Any]:
    """naive over optimized per trained token at `totals`, its paired interval; `text`."""
    per = {p: [s / tokens[p] for s in rounds[p]] for p in ("naive", "optimized")}
    ratio = (totals["naive"] / tokens["naive"]) / (totals["optimized"] / tokens["optimized"])
    paired = [n / o for n, o in zip(per["naive"], per["optimized"]) if o > 0]
    _, low, high = median_interval(paired) if paired else (ratio, ratio, ratio)
    n = min(len(per["naive"]), len(per["optimized"]))
    gap = compare(per["optimized"], per["naive"])
    unit = "CPU s" if clock == "CPU" else "s"
    said = (f"naive {totals['naive']:.3g} {unit} -> optimized {totals['optimized']:.3g} {unit}"
            f" per start: {ratio:.2g}x faster per trained token")
    if gap.resolved:
        said += f", resolved over {n} interleaved rounds ({low:.2g}x-{high:.2g}x)"
    elif n < MIN_SAMPLES:
        said += (f", not resolved in {n} round{'s' * (n != 1)} (a gap needs {MIN_SAMPLES}; "
                 "a run without --quick repeats until it resolves)")
    else:
        said += f", not resolved over {n} rounds: within noise ({low:.2g}x-{high:.2g}x)"
    return {"naive_s": totals["naive"], "optimized_s": totals["optimized"], "speedup": ratio,
            "low": low, "high": high, "rounds": n, "resolved": gap.resolved, "clock": clock,
            "text": said}


def rounds_of(rows: pd.DataFrame, clock: str) -> dict[str, list[float]]:
    """Each plan's per-round total on `clock` from the runs' rows (download is in load_model)."""
    runs = rows[(rows["when"] == "runs") & (rows["clock"] == clock)
                & (rows["stage"] != "download")]
    per = runs.groupby(["plan", "round"], sort=True)["seconds"].sum()
    return {p: list(per[p]) for p in per.index.get_level_values(0).unique()}


def restated(checked: pd.DataFrame, met: Sequence[float], timed: Sequence[float],
             clock: str) -> pd.DataFrame:
    """The step stages' check at the runs' speed (x met / timed) where met and timed resolve."""
    if not met or not timed:
        return checked
    gap, unit = compare(timed, met), "CPU s" if clock == "CPU" else "s"
    scale = statistics.median(met) / statistics.median(timed)
    line = (f"; the naive step the runs met {statistics.median(met):.3g} {unit} vs "
            f"{statistics.median(timed):.3g} {unit} timed before them: {gap.describe()}"
            + (f", so predicted at the runs' speed (x {scale:.3g})" if gap.resolved else ""))
    out = checked.copy()
    for i in out.index[out["stage"].isin(["warmup", "train"])]:
        r = out.loc[i]
        predicted, evidence = r["predicted_s"], r["evidence"] + line
        if gap.resolved and predicted == predicted and predicted is not None:
            evidence += f" (before: {predicted:.3g} {unit})"
            predicted *= scale
        for key, value in judged(r["stage"], r["finding"], predicted, r["measured_s"],
                                 evidence).items():
            out.at[i, key] = value
    return out


def tell(measured: pd.DataFrame, counts: Mapping[str, Mapping[str, float]], clock: str,
         fixes: Mapping[str, Sequence[str]], tokens: Mapping[str, float],
         met: Sequence[float] = ()) -> dict[str, pd.DataFrame]:
    """The cost table, the savings predicted vs measured, the waterfall and the headline."""
    costs = table(measured)
    before, runs = (price(costs, counts, clock=clock, when=when) for when in ("before", "runs"))
    timed = measured[(measured["when"] == "before") & (measured["plan"] == "naive")
                     & (measured["stage"] == "train") & (measured["clock"] == clock)]
    savings = restated(check(before, runs, clock, fixes), met, list(timed["seconds"]), clock)
    flow = waterfall(runs, clock, fixes)
    totals = dict(zip(flow["bar"], flow["seconds"]))
    head = headline(rounds_of(measured, clock), tokens, clock, totals)
    return {"costs": costs, "savings": savings, "waterfall": flow,
            "comparison": pd.DataFrame([head | {"changed": ",".join(fixes)}])}
