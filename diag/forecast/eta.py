"""The projection: a job's wall seconds before it runs, from the cost table, then checked.

`job_counts` counts a run in the cost table's units, `price` (diag.forecast.costs) prices it,
`check_eta` sets each stage beside what the run measured. Costs: a run folder's projection
(`costs_in`) or, before any run, the job's decisions (`from_decisions`). Always wall seconds.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from diag.decision import by_setting
from diag.forecast.costs import COLUMNS, FORWARD_SHARE, with_eval
from diag.forecast.story import ORDER, judged

if TYPE_CHECKING:
    from diag.decision import Decision


def job_counts(steps: int, warmup: int, tokens_per_step: float, slots_per_step: float,
               every_eval: int, every_save: int, eval_slots: float, done: int = 0,
               built_bytes: float = 0, records: int = 0) -> dict[str, float]:
    """A run's counts in cost units, from step `done` on (evals and saves at their cadence)."""
    left, warm = steps - done, min(warmup, steps - done)
    evals = (0 if done else 1) + steps // every_eval - done // every_eval + bool(
        steps % every_eval)
    saves = steps // every_save - done // every_save + bool(steps % every_save) + 1
    return {"start": 1, "source": 1, "byte": built_bytes, "record": records,
            "token": left * tokens_per_step, "warmup_slot": warm * slots_per_step,
            "slot": (left - warm) * slots_per_step, "save": saves,
            "eval_slot": evals * eval_slots}


def run_counts(summary: Mapping[str, Any]) -> dict[str, float]:
    """What one comparison run did (diag.qlora's summary), in the cost table's units."""
    warm = int(summary["warmup_steps"])
    per_step = summary["token_slots"] / summary["steps"]
    whole = summary.get("source_bytes") or 0
    return {"start": 1, "source": summary["fetched_bytes"] / whole if whole else 1.0,
            "record": summary["records"], "warmup_slot": warm * per_step,
            "slot": (summary["steps"] - warm) * per_step, "warmup_step": warm,
            "step": summary["steps"] - warm, "save": summary["saves"]}


def runs_costs(costs: pd.DataFrame, plan: str) -> pd.DataFrame:
    """A comparison's wall costs of `plan` as its runs measured them, with the eval row."""
    mine = costs[(costs["plan"] == plan) & (costs["when"] == "runs") & (costs["clock"] == "wall")
                 & (costs["stage"] != "download")]
    return with_eval(mine)


def costs_in(folder: str | os.PathLike[str], plan: str) -> pd.DataFrame | None:
    """The costs a run folder's projection priced for `plan` (None: the folder holds none)."""
    path = Path(folder) / "qlora_projection_costs.csv"
    if not path.is_file():
        return None
    table = pd.read_csv(path)
    mine = table[table["plan"] == plan]
    return mine.assign(evidence=f"{folder}: " + mine["evidence"]) if not mine.empty else None


def from_decisions(plan: str, settings: Mapping[str, Any], decisions: Iterable[Decision],
                   build: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """A plan's wall costs before any run, from its decisions and the token cache's build."""
    got = by_setting(decisions)

    def cost(stage: str, unit: str, seconds: float | None, why: str) -> dict[str, Any]:
        return {"plan": plan, "stage": stage, "unit": unit, "seconds": seconds, "low": seconds,
                "high": seconds, "samples": 1, "clock": "wall", "when": "before",
                "evidence": why}

    rows = []
    for setting, stage in (("fetch", "fetch_data"), ("model_cache", "load_model")):
        d = got.get(setting)
        if d is not None and (d.clock or "wall") == "wall":
            seconds = d.chosen_s if settings[setting] == d.value else d.baseline_s \
                if settings[setting] == d.baseline else None
            rows.append(cost(stage, "start", seconds, f"the {setting} decision's per start"))
    if build and build.get("bytes") and build.get("seconds"):
        rate = build["bytes"] / build["seconds"]
        rows.append(cost("preprocess", "byte", 1 / rate, f"the token cache's recorded build, "
                                                         f"{rate / 1e6:.3g} MB/s"))
    micro, ckpt = got.get("micro_batch"), got.get("gradient_checkpointing")
    slots = micro.measured_on.tokens_per_step if micro is not None else None
    walls = [r["seconds_per_step"] for r in (micro.rows if micro is not None else ())
             if r.get("micro_batch") == settings["micro_batch"] and r.get("seconds_per_step")]
    if walls and slots:
        step, why = statistics.median(walls), f"{micro.source}: {micro.evidence()}"
        if settings["gradient_checkpointing"]:
            ratio = ckpt.naive_ratio if ckpt is not None else None
            step, why = (step * ratio, f"{why}; x {ratio:.3g}, checkpointing on/off") if ratio \
                else (None, f"{why}; no checkpointing ratio")
        if step is not None:
            rows += [cost(stage, unit, step / slots * share, why) for stage, unit, share in
                     (("warmup", "warmup_slot", 1.0), ("train", "slot", 1.0),
                      ("eval", "eval_slot", FORWARD_SHARE))]
    if settings["pipeline"] == "naive" and build and build.get("tokens_per_s"):
        token = build.get("processes", 1) / build["tokens_per_s"]  # one process, in the loop
        rows.append(cost("train", "token", token, "tokenized per sample in the loop, at the "
                         f"token cache's build rate per process ({1 / token:,.0f} tokens/s)"))
    return pd.DataFrame(rows, columns=COLUMNS)


def check_eta(projected: pd.DataFrame, stages: pd.DataFrame) -> pd.DataFrame:
    """Per run-level stage the ETA (None: unpriced) beside the run's seconds, and `total`."""
    measured = stages[stages["step"].isna()].groupby("stage")["seconds"].sum()
    priced = projected.set_index("stage")
    rows = [judged(stage, "predicted before the run",
                   float(priced.at[stage, "seconds"]) if stage in priced.index else None,
                   float(measured.get(stage, 0.0)),
                   str(priced.at[stage, "evidence"]) if stage in priced.index else "not priced")
            for stage in dict.fromkeys([*ORDER, *priced.index, *measured.index])
            if stage in priced.index or stage in measured.index]
    left = [r["stage"] for r in rows if r["predicted_s"] is None]
    rows.append(judged("total", "the whole run, predicted before it",
                       float(projected["seconds"].sum()), float(measured.sum()),
                       "not predicted: " + ", ".join(left) if left else "every stage predicted"))
    return pd.DataFrame(rows)


def duration(seconds: float) -> str:
    """3.2 s, 4.5 min, 2 h 40 min: a time a person reads at a glance."""
    if seconds < 90:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def before_line(head: str, projected: pd.DataFrame, spent_s: float = 0.0,
                done: tuple[str, ...] = ()) -> str:
    """The projection in one line: the whole command in wall seconds, each stage's share."""
    total = float(projected["seconds"].sum())
    if not total:
        return (f"{head}; no projection: nothing measured before prices this job's stages (decide "
                "the plan on the job, or give --results runs/<id>)")
    shares = ", ".join(f"{r.stage} {r.seconds / total:.0%}" for r in projected.sort_values(
        "seconds", ascending=False).itertuples() if r.seconds / total >= 0.005)
    left = [s for s in ORDER if s not in set(projected["stage"])]
    whole = spent_s + float(projected.loc[~projected["stage"].isin(done), "seconds"].sum())
    return (f"{head}; projected {duration(whole)} (wall) for the whole command"
            + (f", {duration(spent_s)} of it spent (deciding the plan, fetch, load, "
               "preprocess)" if spent_s else "")
            + f", from earlier measurements: {shares}"
            + (f" (not priced: {', '.join(left)})" if left else "")
            + "; the ETA follows once this run's own steps are timed")


def after_line(checked: pd.DataFrame) -> str:
    """Predicted vs measured as one line: the whole run, and the stages past the tolerance."""
    total = checked.set_index("stage").loc["total"]
    off = checked[(checked["stage"] != "total") & checked["flagged"].astype(bool)]
    err = f"{(total.measured_s - total.predicted_s) / total.predicted_s:+.0%}" \
        if total.predicted_s else "n/a"
    return (f"measured {duration(total.measured_s)} against {duration(total.predicted_s)} "
            f"predicted ({err})" + ("; off by more than the tolerance: " + ", ".join(
                f"{r.stage} {duration(r.measured_s)} vs {duration(r.predicted_s)}"
                for r in off.itertuples()) if not off.empty else ""))
