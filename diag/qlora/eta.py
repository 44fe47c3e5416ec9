"""What a QLoRA job will take, said before it runs from earlier measurements only, then checked.

A plan's costs are rows (COLUMNS): a stage, what it scales with (`per`: a start, a token slot
trained (warm-up or steady) or evaluated, a byte of source tokenized into the cache, a record, a
checkpoint save, a trained token tokenized in the loop) and the seconds each costs, with the
figures they rest on. `from_runs` reads them off a
QLoRA comparison (what `diag run` measured: the Trainer's own steps); `from_decisions` off the
decisions measured on the job's step and the token cache's recorded build rate (what `diag train`
knows before its first step). `project(costs, counts)` prices each stage of a job; `check_eta`
sets each prediction beside what the run measured (diag.qlora.predict.check, flagged past
PREDICTION_TOLERANCE). An evaluated token slot costs a third of a trained one (forward only).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.decision import by_setting
from diag.qlora.predict import check

if TYPE_CHECKING:
    import pandas as pd

    from diag.decision import Decision
    from diag.qlora.plans import Plan

COLUMNS = ["plan", "stage", "per", "seconds", "evidence"]
FORWARD_SHARE = 1 / 3  # an evaluated slot's cost over a trained one's: forward, no backward
ORDER = ("fetch_data", "load_model", "preprocess", "setup", "warmup", "train", "checkpoint",
         "eval")


def _row(plan: str, stage: str, per: str, seconds: float | None, why: str) -> dict[str, Any]:
    return {"plan": plan, "stage": stage, "per": per, "seconds": seconds, "evidence": why}


def _step_rows(plan: str, slot: float | None, why: str) -> list[dict[str, Any]]:
    """A token slot's cost as the warm-up and the steady steps train it, and as the evals pay
    it forward only (one record a row: they pay its padding too)."""
    fwd = slot * FORWARD_SHARE if slot is not None else None
    return [_row(plan, "warmup", "warmup_slot", slot, why), _row(plan, "train", "slot", slot, why),
            _row(plan, "eval", "eval_slot", fwd, f"{FORWARD_SHARE:.2g} of a trained slot "
                                                 f"(forward only): {why}")]


def _fetch_row(r: Any, seconds: float | None, said: str) -> dict[str, Any]:
    """A start's fetch of the whole source: the run fetched the shards its records were in
    (diag.qlora.job.fetch_data), so its seconds scale by the source's bytes over those."""
    fetched, whole = getattr(r, "fetched_bytes", None), getattr(r, "source_bytes", None)
    if seconds is None or not fetched or not whole or fetched >= whole:
        return _row(r.plan, "fetch_data", "start", seconds, f"{said}: per start")
    return _row(r.plan, "fetch_data", "start", seconds * whole / fetched,
                f"{said}: per start, extrapolated from the {fetched / 1e6:.4g} MB its records "
                f"were in to the source's {whole / 1e6:.4g} MB")


def from_runs(frame: pd.DataFrame, stages: pd.DataFrame, build: Mapping[str, Any] | None = None
              ) -> pd.DataFrame:
    """Each plan's costs off a QLoRA comparison: `frame` (one row per plan: real_tokens, steps,
    records), `stages` (its StageTimer rows, `run` = plan). The steady steps price a trained
    token, the first ones' excess over that a start; build: the token cache's recorded build
    (meta.json's "build": bytes, seconds) prices a byte to tokenize."""
    import pandas as pd

    rows = []
    for r in frame.itertuples():
        mine = stages[(stages["run"] == r.plan) & stages["step"].isna()]
        spent = mine.groupby("stage")["seconds"].sum()
        saves = int((mine["stage"] == "checkpoint").sum())
        warm = int((mine["stage"] == "warmup").sum())  # one row per warm-up step
        per_step, steady = r.token_slots / r.steps, r.steps - warm
        slot = spent.get("train", 0.0) / (per_step * steady) if steady else None
        said = f"the {r.plan} run of {int(r.records)} records, {int(r.steps)} steps"
        rows.append(_fetch_row(r, spent.get("fetch_data"), said))
        for stage in ("load_model", "setup"):
            rows.append(_row(r.plan, stage, "start", spent.get(stage), f"{said}: per start"))
        if r.plan == "naive":  # its records are read and wrapped per start, per record
            rows.append(_row(r.plan, "preprocess", "record", spent.get("preprocess", 0.0)
                             / r.records, f"{said}: its read, per record"))
        else:
            rows.append(_row(r.plan, "preprocess", "start", spent.get("preprocess"),
                             f"{said}: the token cache's check (a hit)"))
        rows.append(_build_row(r.plan, build))
        start = spent.get("warmup", 0.0) - (slot or 0.0) * per_step * warm
        rows.append(_row(r.plan, "warmup", "start", max(start, 0.0),
                         f"{said}: its {warm} warm-up step(s) beyond the steady rate"))
        rows += _step_rows(r.plan, slot, f"{said}: {spent.get('train', 0.0):.3g} s over its "
                                         "steady steps' token slots")
        rows.append(_row(r.plan, "checkpoint", "save", spent.get("checkpoint", 0.0) / saves
                         if saves else None, f"{said}: {saves} save(s)"))
    return pd.DataFrame(rows, columns=COLUMNS)


def costs_in(folder: str | os.PathLike[str], plan: str) -> pd.DataFrame | None:
    """The costs a run folder measured for plan: its whole-job projection's (`diag run`), else
    its QLoRA comparison's (`diag qlora --report`); None where it holds neither."""
    import pandas as pd

    folder = Path(folder)
    if (folder / "qlora_projection_costs.csv").is_file():
        costs = pd.read_csv(folder / "qlora_projection_costs.csv")
    elif (folder / "qlora.csv").is_file() and (folder / "run.csv").is_file():
        costs = from_runs(pd.read_csv(folder / "qlora.csv"), pd.read_csv(folder / "run.csv"))
    else:
        return None
    mine = costs[costs["plan"] == plan]
    return mine.assign(evidence=f"{folder}: " + mine["evidence"]) if not mine.empty else None


def _build_row(plan: str, build: Mapping[str, Any] | None) -> dict[str, Any]:
    if not build or not build.get("bytes") or not build.get("seconds"):
        return _row(plan, "preprocess", "byte", None, "no token cache build recorded")
    rate = build["bytes"] / build["seconds"]
    return _row(plan, "preprocess", "byte", 1 / rate,
                f"the token cache's recorded build: {rate / 1e6:.3g} MB/s with "
                f"{build.get('processes', '?')} processes")


def _seconds(d: Decision | None, value: Any) -> float | None:
    """What the decision measured for this value: its chosen or its baseline seconds."""
    if d is None:
        return None
    return d.chosen_s if value == d.value else d.baseline_s if value == d.baseline else None


def from_decisions(plan: Plan, decisions: Iterable[Decision],
                   build: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """The plan's costs off the decisions measured before (on the job's step; storage and
    model_load's per start where given) and the token cache's recorded build: a token slot at
    the step the micro-batch sweep timed for the plan's micro-batch (checkpointing's on/off
    ratio where the plan keeps it on: the sweep ran without), the naive plan's per-sample
    tokenizing at one build process's rate."""
    import pandas as pd

    got, name = by_setting(decisions), plan.name
    rows = [_row(name, "fetch_data", "start", _seconds(got.get("fetch"), plan.fetch),
                 "the fetch decision's seconds per start"),
            _row(name, "load_model", "start", _seconds(got.get("model_cache"), plan.model_cache),
                 "the model_cache decision's seconds per start"),
            _row(name, "setup", "start", None, "no Trainer set-up measured before"),
            _row(name, "checkpoint", "save", None, "no save measured before"),
            _build_row(name, build)]
    micro, ckpt = got.get("micro_batch"), got.get("gradient_checkpointing")
    step = _seconds(micro, plan.micro_batch) if micro is not None else None
    slots = micro.measured_on.tokens_per_step if micro is not None else None
    why = f"{micro.source}: {micro.evidence()}" if micro is not None else "no micro-batch timed"
    if step is not None and plan.gradient_checkpointing:
        ratio = ckpt.naive_ratio if ckpt is not None else None
        step = step * ratio if ratio else None
        why += f"; x {ratio:.3g}: checkpointing on/off" if ratio else "; no checkpointing ratio"
    rows += _step_rows(name, step / slots if step and slots else None, why)
    if plan.pipeline == "naive" and build and build.get("tokens_per_s"):
        token = build.get("processes", 1) / build["tokens_per_s"]
        rows += [_row(name, "train", "token", token, "tokenized per sample in the loop: the "
                      f"token cache's build rate per process ({1 / token:,.0f} tokens/s)")]
    return pd.DataFrame(rows, columns=COLUMNS)


def project(costs: pd.DataFrame, counts: Mapping[str, float]) -> pd.DataFrame:
    """Each stage's predicted seconds (None where no cost prices it) for a job of `counts`
    (units of `per` -> how many), with the sums it rests on."""
    import pandas as pd

    rows = []
    for (plan, stage), part in costs.groupby(["plan", "stage"], sort=False):
        priced = [(r.seconds, counts.get(r.per, 0)) for r in part.itertuples()
                  if r.seconds == r.seconds and r.seconds is not None]
        said = "; ".join(f"{r.per} x {counts.get(r.per, 0):,.0f} ({r.evidence})"
                         for r in part.itertuples())
        rows.append({"plan": plan, "stage": stage,
                     "predicted_s": sum(s * n for s, n in priced) if priced else None,
                     "evidence": said})
    out = pd.DataFrame(rows, columns=["plan", "stage", "predicted_s", "evidence"])
    order = {s: i for i, s in enumerate(ORDER)}
    return out.sort_values(["plan", "stage"], key=lambda c: c.map(order) if c.name == "stage"
                           else c, kind="stable", ignore_index=True)


def job_counts(steps: int, warmup: int, tokens_per_step: float, slots_per_step: float,
               every_eval: int, every_save: int, eval_slots: float, done: int = 0,
               built_bytes: float = 0, records: int = 0) -> dict[str, float]:
    """A run's counts in project's units: the steps after `done` (a resume's), their trained
    tokens and their slots (warm-up apart); the evals (one before the first step of a fresh
    run, one every every_eval steps, one at the end) of eval_slots each; the saves (every
    every_save, at the end, and the output); the bytes a cache build reads; the records the
    naive plan reads."""
    left, warm = steps - done, min(warmup, steps - done)
    evals = (0 if done else 1) + steps // every_eval - done // every_eval + bool(
        steps % every_eval)
    saves = steps // every_save - done // every_save + bool(steps % every_save) + 1
    return {"start": 1, "byte": built_bytes, "record": records, "token": left * tokens_per_step,
            "warmup_slot": warm * slots_per_step, "slot": (left - warm) * slots_per_step,
            "save": saves, "eval_slot": evals * eval_slots}


def check_eta(projected: pd.DataFrame, stages: pd.DataFrame) -> pd.DataFrame:
    """Per run-level stage the ETA's seconds beside the run's (its StageTimer rows), and the
    whole run's as `total` (the unpredicted stages' measured seconds inside it, said)."""
    import pandas as pd

    measured = stages[stages["step"].isna()].groupby("stage")["seconds"].sum()
    rows = [check(r.stage, "predicted before the run", r.predicted_s
                  if r.predicted_s == r.predicted_s else None,
                  float(measured.get(r.stage, 0.0)), r.evidence)
            for r in projected.itertuples()]
    unpredicted = [r["stage"] for r in rows if r["predicted_s"] is None]
    total = projected["predicted_s"].dropna().sum()
    rows.append(check("total", "the whole run, predicted before it", float(total),
                      float(measured.sum()), "not predicted: " + ", ".join(unpredicted)
                      if unpredicted else "every stage predicted"))
    return pd.DataFrame(rows)


def duration(seconds: float) -> str:
    """3.2 s, 4.5 min, 2 h 40 min: a time a person reads at a glance."""
    if seconds < 90:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def before_line(head: str, projected: pd.DataFrame) -> str:
    """The ETA as one line: what the job is (head), the predicted total and each stage's share
    of it, the stages nothing predicted."""
    priced = projected.dropna(subset=["predicted_s"])
    total = float(priced["predicted_s"].sum())
    shares = ", ".join(f"{r.stage} {r.predicted_s / total:.0%}" for r in priced.sort_values(
        "predicted_s", ascending=False).itertuples() if total and r.predicted_s / total >= 0.005)
    left = sorted(set(projected["stage"]) - set(priced["stage"]))
    if not total:
        return (f"{head}; no ETA: nothing measured before prices this job's stages (decide the "
                "plan on the job, or give --results runs/<id>)")
    return (f"{head}; ETA {duration(total)}, predicted before the run from earlier "
            f"measurements: {shares}" + (f" (not predicted: {', '.join(left)})" if left else ""))


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
