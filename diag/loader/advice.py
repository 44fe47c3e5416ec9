"""From the loader sweep to decisions: the fewest num_workers whose median data_wait stays under
the goal, else the per-sample cost and the workers it needs; `advice` prices them as findings."""
from __future__ import annotations

import functools
import math
from typing import Any

import pandas as pd

from diag.decision import (ADVICE, DATA_WAIT_GOAL, DATA_WAIT_NEAR_BEST, DATA_WAIT_NEAR_BEST_S,
                           FIXES, Decision, MeasuredOn)
from diag.machine import device
from diag.noise import compare, spread

COLUMNS = ["pipeline", "recommended_workers", "data_wait_share", "baseline_workers",
           "baseline_share", "per_sample_ms", "per_batch_ms", "step_ms", "workers_needed",
           "cores", "samples_per_s", "tokens_per_s", "failed_workers", "verdict"]
_default = functools.partial(Decision.default, source="loader")  # a labelled loader default
DEFAULT_WORKERS = 2  # no sweep: the token cache's reads overlap a step (docs/calibration.md)


def _good(part: pd.DataFrame) -> pd.DataFrame:
    """The points that ran (a frame without an error column, a sweep of your own: all)."""
    return part[part["error"].fillna("") == ""] if "error" in part else part


def _medians(part: pd.DataFrame) -> pd.DataFrame:
    return _good(part).groupby("num_workers", sort=False)[
        ["data_wait_share", "data_wait_s", "step_s", "samples_per_s", "tokens_per_s"]].median()


def recommend(sweep: pd.DataFrame, target_share: float = DATA_WAIT_GOAL) -> pd.DataFrame:
    """One row per pipeline: the recommended num_workers, or the cost and the cores it needs."""
    rows = []
    for pipeline, part in sweep.groupby("pipeline", sort=False):
        by = _medians(part)
        order = list(dict.fromkeys(part["num_workers"]))
        cores = int(part["cores"].iloc[0]) if "cores" in part else 0
        row = {"pipeline": pipeline, "failed_workers": [w for w in order if w not in by.index],
               "cores": cores}
        if by.empty:
            rows.append({**row, "verdict": "every setting failed: " + part["error"].iloc[0]})
            continue
        batch = int(part["batch_size"].iloc[0])
        rec = next((w for w in sorted(by.index) if by.loc[w, "data_wait_share"] < target_share),
                   None)
        base = order[0] if order[0] in by.index else by.index[0]
        step = float(by["step_s"].median())
        # with no workers every sample is fetched and prepared in the loop: the wait is its cost
        per_batch = float(by.loc[0, "data_wait_s"]) if 0 in by.index else math.nan
        # each worker makes a batch in per_batch seconds; together one per step
        needed = None if math.isnan(per_batch) else 0 if per_batch / (per_batch + step) < \
            target_share else math.ceil(per_batch / step)
        shown = rec if rec is not None else by["data_wait_share"].idxmin()
        if rec is not None:
            verdict = (f"num_workers={rec} keeps data_wait at {by.loc[rec, 'data_wait_share']:.1%} "
                       f"of the step (target < {target_share:.0%})")
        else:
            verdict = (f"no setting keeps data_wait under {target_share:.0%} (best: "
                       f"num_workers={shown} at {by.loc[shown, 'data_wait_share']:.1%})")
            cost = (f"preprocessing costs {per_batch / batch * 1e3:.3g} ms per sample "
                    f"({per_batch * 1e3:.3g} ms per batch of {batch}) against a "
                    f"{step * 1e3:.3g} ms step")
            tried = [w for w in by.index if needed is not None and w >= max(needed, 1)]
            if tried:  # enough workers ran and still waited: the hand-off, not the work
                handoff = float(by.loc[tried, "data_wait_s"].min())
                verdict += (f": {cost}, which {needed or 1} worker(s) would hide, yet with "
                            f"workers the loop still waits {handoff * 1e3:.3g} ms per batch: "
                            "that is the hand-off from worker processes and the loop's own "
                            "overhead, which only a longer step (a larger batch) amortizes")
            elif needed:
                verdict += (f": {cost}, so it needs {needed} workers on as many free cores "
                            f"(this machine has {cores}), or the token cache (packed)")
        rows.append({**row, "recommended_workers": rec, "baseline_workers": base,
                     "data_wait_share": by.loc[shown, "data_wait_share"],
                     "baseline_share": by.loc[base, "data_wait_share"],
                     "per_sample_ms": per_batch / batch * 1e3, "per_batch_ms": per_batch * 1e3,
                     "step_ms": step * 1e3, "workers_needed": needed, "verdict": verdict,
                     **by.loc[shown, ["samples_per_s", "tokens_per_s"]]})
    out = pd.DataFrame(rows, columns=COLUMNS).astype(dict.fromkeys(
        ["recommended_workers", "workers_needed", "baseline_workers"], "Int64"))
    out["failed_workers"] = out["failed_workers"].map(lambda ws: ",".join(map(str, ws or [])))
    return out


def advice(sweep: pd.DataFrame, recommendation: pd.DataFrame, run_steps: int = 1000,
           target_share: float = DATA_WAIT_GOAL) -> pd.DataFrame:
    """Findings rows (stage, finding, seconds_saved, evidence), priced for run_steps steps."""
    rows = []
    waits = {p: _medians(part) for p, part in sweep.groupby("pipeline", sort=False)}
    for r in recommendation.itertuples():
        by = waits[r.pipeline]
        if by.empty or pd.isna(r.baseline_workers) or r.baseline_share < target_share:
            continue  # the baseline keeps up: nothing to fix
        kept_up = not pd.isna(r.recommended_workers)
        # none keeps up: the one rule the plan decides by (the smallest near the best wait)
        best = int(r.recommended_workers) if kept_up else choose_workers(by, target_share)[0]
        saved = by.loc[r.baseline_workers, "data_wait_s"] - by.loc[best, "data_wait_s"]
        share = by.loc[best, "data_wait_share"]
        finding = (f"DataLoader(num_workers={best}, persistent_workers=True, pin_memory=True) "
                   f"keeps the {r.pipeline} pipeline ahead of the step" if kept_up else
                   f"workers alone leave the {r.pipeline} pipeline at {share:.1%} of the step: "
                   "cache the tokens (diag.data.build_token_cache + PackedDataset)")
        evidence = (f"{r.pipeline} pipeline: data_wait {r.baseline_share:.1%} of the step at "
                    f"num_workers={r.baseline_workers}, {share:.1%} at num_workers={best} "
                    f"({r.step_ms:.3g} ms step; {run_steps} steps)"
                    + ("" if kept_up else f"; {r.verdict}"))
        if saved > 0:
            rows.append(("data_wait", finding, float(saved) * run_steps, evidence))
    # tokenize once and pack: what the naive loop's wait and padding cost, where measured
    naive, packed = waits.get("naive", pd.DataFrame()), waits.get("packed", pd.DataFrame())
    w = next((w for w in naive.index if w in packed.index), None)
    if w is None or naive.loc[w, "data_wait_share"] < target_share:
        return pd.DataFrame(rows, columns=ADVICE)
    saved = (naive.loc[w, "data_wait_s"] - packed.loc[w, "data_wait_s"]) * run_steps
    ran = _good(sweep[sweep["pipeline"] == "naive"])
    fill = float(ran["tokens_per_s"].median() / ran["samples_per_s"].median()) / float(
        sweep["seq_len"].iloc[0]) if "seq_len" in sweep else math.nan
    ratio = packed.loc[w, "tokens_per_s"] / naive.loc[w, "tokens_per_s"]
    evidence = (f"at num_workers={w}: data_wait {naive.loc[w, 'data_wait_share']:.1%} (naive) vs "
                f"{packed.loc[w, 'data_wait_share']:.1%} (packed) of the step; packed serves "
                f"{ratio:.2f}x the tokens per second" + ("" if math.isnan(fill) else
                f"; naive batches are {1 - fill:.0%} padding, compute a packed step "
                "does not waste"))
    if saved > 0:
        rows.append(("data_wait", FIXES["pipeline"], float(saved), evidence))
    return pd.DataFrame(rows, columns=ADVICE)


def choose_workers(by: pd.DataFrame, goal: float = DATA_WAIT_GOAL) -> tuple[int, str]:
    """(num_workers, why): the fewest under `goal`, else the fewest near the best wait."""
    w = next((w for w in sorted(by.index) if by.loc[w, "data_wait_share"] < goal), None)
    if w is not None:
        return int(w), (f"the fewest workers under {goal:.0%} data_wait: {w} at "
                        f"{by.loc[w, 'data_wait_share']:.1%} of the step")
    best = float(by["data_wait_s"].min())
    near_best = max(best * (1 + DATA_WAIT_NEAR_BEST), best + DATA_WAIT_NEAR_BEST_S)
    near = [w for w in sorted(by.index) if by.loc[w, "data_wait_s"] <= near_best]
    w, at = near[0], int(by["data_wait_s"].idxmin())  # more workers do not hand over faster
    return int(w), (f"no setting under {goal:.0%} data_wait; {w} workers is the fewest within "
                    f"{DATA_WAIT_NEAR_BEST:.0%} (or {DATA_WAIT_NEAR_BEST_S * 1e3:.3g} ms) of the "
                    f"best, {best * 1e3:.3g} ms per step at {at} workers "
                    f"({by.loc[w, 'data_wait_share']:.1%} of the step); the "
                    f"{by.loc[w, 'data_wait_s'] * 1e3:.3g} ms left is the worker hand-off "
                    "(collate, pass the batch between processes), which more workers do not "
                    "remove")


def decide(sweep: pd.DataFrame | None, goal: float = DATA_WAIT_GOAL,
           measured_on: MeasuredOn | None = None) -> tuple[Decision, ...]:
    """pipeline, num_workers (the baseline's unless a lower wait resolves), knobs (or defaults)."""
    ok = _good(sweep) if sweep is not None else None
    if ok is None or ok.empty:
        why = ("loader frame absent" if sweep is None or sweep.empty
               else "every loader sweep point failed: " + str(sweep["error"].iloc[0]))
        n = default_workers()
        return (_default("pipeline", "packed", f"{why}: the packed token cache"),
                _default("num_workers", n, f"{why}: {n} workers (two cores left to the step)"),
                *(_default(k, v, f"{why}: the documented default") for k, v in _knobs(n).items()))
    ok = ok.reset_index(drop=True)  # sweeps concatenated by a caller repeat index labels
    on = measured_on or MeasuredOn(step=str(ok["consumer"].iloc[0]) if "consumer" in ok else "",
                                   seq_len=int(ok["seq_len"].iloc[0]) if "seq_len" in ok else None)
    rates = ok.groupby("pipeline")["tokens_per_s"].median()
    pipeline, pipe_note, pipe_sure = _pipeline(ok, rates)
    mine = ok[ok["pipeline"] == pipeline]
    by = _medians(mine)
    workers, why = choose_workers(by, goal)
    base_w = 0 if 0 in by.index else int(min(by.index))
    workers, why, sure = _resolved_workers(mine, base_w, workers, why)
    common = {"source": "loader", "measured_on": on, "stage": "data_wait", "per": "step"}
    chosen_s = float(by.loc[workers, "data_wait_s"])
    out = [Decision.from_rows("num_workers", workers, f"{pipeline} pipeline: {why}", mine,
                              baseline=0, baseline_s=float(by.loc[0, "data_wait_s"]) if
                              base_w == 0 else None, chosen_s=chosen_s, **sure, **common)]
    naive = _medians(ok[ok["pipeline"] == "naive"]) if "naive" in rates else None
    pipe_rows = ok[ok["num_workers"] == workers]
    out.append(Decision.from_rows(
        "pipeline", pipeline, "real tokens/s per pipeline (medians): " + ", ".join(
            f"{p} {r:,.0f}" for p, r in rates.items()) + pipe_note, pipe_rows, baseline="naive",
        baseline_s=float(naive.loc[workers, "data_wait_s"]) if naive is not None
        and workers in naive.index else None, chosen_s=chosen_s, **pipe_sure, **common))
    chosen = mine[mine["num_workers"] == workers]
    for setting, default in _knobs(workers).items():
        values = mine[setting].dropna().unique() if setting in mine else []
        # varied at one num_workers (following the worker count is no evidence for a knob)
        if setting in mine and mine.groupby("num_workers")[setting].nunique().max() > 1:
            best = chosen.loc[chosen["data_wait_s"].idxmin()]
            value = None if workers == 0 and setting == "prefetch_factor" else (
                int(best[setting]) if setting == "prefetch_factor" else bool(best[setting]))
            out.append(Decision.from_rows(setting, value, "varied in the sweep; the lowest "
                                          f"data_wait at {workers} workers", chosen, **common))
        else:
            ran = f" (every point ran {values[0]})" if len(values) else ""
            out.append(_default(setting, default, f"not varied by the sweep{ran}: the documented "
                                "default"))
    return tuple(out)


def _pipeline(ok: pd.DataFrame, rates: pd.Series) -> tuple[str, str, dict[str, Any]]:
    """(pipeline, note, how sure): not naive only where it resolves faster, never slower."""
    per = {(p, int(w)): list(1 / g["tokens_per_s"])
           for (p, w), g in ok.groupby(["pipeline", "num_workers"])}
    other = [p for p in rates.index if p != "naive"]
    if "naive" not in rates.index or not other:  # nothing to keep or compare: the fastest
        return str(rates.idxmax()), "", {}
    best = str(rates[other].idxmax())
    gaps = {w: compare(per[(best, w)], per[("naive", w)]) for p, w in per
            if p == best and ("naive", w) in per}
    wins = [w for w, g in gaps.items() if g.faster == "a"]
    pick = best if wins and not any(g.faster == "b" for g in gaps.values()) else "naive"
    w = wins[0] if wins else next(iter(gaps), None)
    if w is None:
        return "naive", "", {}
    said = "; ".join(f"{n} worker{'s' * (n != 1)}: {g.describe()}" for n, g in gaps.items())
    return pick, f"; seconds per token, {best} against naive at each worker count: {said}", {
        **gaps[w].sure(), "resolved": bool(wins) and pick == best}


def _resolved_workers(rows: pd.DataFrame, base: int, workers: int, why: str
                      ) -> tuple[int, str, dict[str, Any]]:
    """choose_workers' pick where its wait resolves below `base` workers'; else `base`, kept."""
    waits = {w: list(g["data_wait_s"]) for w, g in rows.groupby("num_workers")}
    if workers == base:  # nothing to resolve: the baseline itself
        mine = waits[base]
        return workers, f"{why} ({len(mine)} samples, spread {spread(mine):.0%})", {
            "samples": (len(mine),), "spread": (spread(mine),)}
    gap = compare(waits[workers], waits[base])
    if gap.faster == "a":
        return workers, f"{why}; against {base} workers' wait: {gap.describe()}", gap.sure()
    return base, (f"{base} workers kept: {workers} would be picked ({why}), but its wait "
                  f"against {base} workers' is {gap.describe()}"), {**gap.sure(), "resolved": False}


def _knobs(workers: int) -> dict[str, Any]:
    """The documented defaults for the settings a worker sweep does not vary."""
    return {"pin_memory": True, "persistent_workers": workers > 0,
            "prefetch_factor": 2 if workers else None}


def default_workers() -> int:
    """DEFAULT_WORKERS where two cores stay free for the step's threads, else fewer."""
    return max(0, min(DEFAULT_WORKERS, device.usable_cores() - 2))
