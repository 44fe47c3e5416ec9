"""Naive vs optimized QLoRA run on the same records, seed and schedule: where the time went.

`run_qlora(cfg)` runs the plans (cfg.plan) against the same sources and returns one row per plan
(end-to-end seconds, padding share, final loss), the stage rows, the loss curves, the shares
(diag.amdahl), each plan's settings with their evidence, and fix by fix the predicted vs the
measured saving (a prediction off by more than 25% is flagged, not hidden).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.qlora.plans import Plan
from diag.timing import median_seconds

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import QLoraConfig

PREDICTION_TOLERANCE = 0.25  # |measured - predicted| above this share of predicted is flagged
# Result frames the optimized plan reads from a run folder, by the CSV names report.write gives.
RESULT_FILES = {"storage": ("storage",), "model_load": ("model_load",),
                "loader": ("loader", "workers"), "accum": ("accum",)}
FIXES = {
    "fetch_data": "land the dataset once (diag.storage.land) instead of pulling it every start",
    "load_model": "load the base from a persistent HF cache instead of downloading it",
    "preprocess": "tokenize once into a cached, packed token file",
    "warmup": "fewer, larger steps start faster (micro-batch, workers started once)",
    "train": "larger micro-batch, packed rows (no padding), checkpointing off with headroom, "
             "DataLoader workers",
    "checkpoint": "fewer, smaller checkpoints (the LoRA adapter only is small)",
}


@dataclass(frozen=True)
class QLoraResult:
    """What `run_qlora` returns (first field: the main table)."""

    frame: pd.DataFrame  # one row per plan: seconds end to end, tokens, padding, final loss
    stages: pd.DataFrame  # StageTimer rows of every plan (`run` = plan name)
    losses: pd.DataFrame  # run, step, loss, learning_rate
    shares: pd.DataFrame  # diag.amdahl.shares of the stages, per plan
    plans: pd.DataFrame  # run, setting, value, evidence
    savings: pd.DataFrame  # stage, predicted_s, measured_s, error_share, flagged, evidence
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence


def load_results(folder: str | Path) -> dict[str, Any]:
    """The experiment frames a run folder holds (CSV per frame), keyed as Plan.optimized reads."""
    import pandas as pd

    if not folder:
        return {}
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"QLoraConfig.results={str(folder)!r}: no such run folder")
    found = {}
    for key, names in RESULT_FILES.items():
        for name in names:
            if (folder / f"{name}.csv").is_file():
                found[key] = pd.read_csv(folder / f"{name}.csv")
                break
    return found


def run_qlora(cfg: QLoraConfig | None = None, results: dict[str, Any] | None = None
              ) -> QLoraResult:
    """Run cfg.plan ("naive", "optimized" or "both"); `results` (frames by experiment) or
    cfg.results (a run folder) feed Plan.optimized."""
    import pandas as pd
    from tqdm.auto import tqdm

    from diag.amdahl import shares
    from diag.config import QLoraConfig
    from diag.qlora.job import open_sources, prime, run_plan
    from diag.preflight import preflight
    from diag.qlora.measure import plan_from_job

    cfg = cfg or QLoraConfig.default()
    preflight(cfg)  # the source flags checked with one listing, before any model loads
    given, results = results, results if results is not None else load_results(cfg.results)
    plans = []
    if cfg.plan in ("naive", "both"):
        plans.append(Plan.naive())
    if cfg.plan in ("optimized", "both"):
        plans.append(plan_from_job(cfg, given))  # measured on the job unless given
    runs = []
    with open_sources(cfg) as src:
        for plan in tqdm(plans, desc="qlora plans", leave=False):
            # an optimized start finds the landed data, cached model and tokens: the first
            # start pays them once, untimed here and reported as once_s
            once = prime(cfg, plan, src) if plan.name == "optimized" else 0.0
            runs.append(run_plan(cfg, plan, src) | {"once_s": once})
    frame = pd.DataFrame([r["summary"] | {"once_s": r["once_s"]} for r in runs])
    stages = pd.concat([r["stages"] for r in runs], ignore_index=True)
    losses = pd.concat([r["losses"] for r in runs], ignore_index=True)
    table = shares(stages)
    plan_rows = pd.concat([p.frame() for p in plans], ignore_index=True)  # what ran
    saved = savings(table, results, frame)
    advice = saved.rename(columns={"measured_s": "seconds_saved"})[
        ["stage", "finding", "seconds_saved", "evidence"]]
    return QLoraResult(frame, stages, losses, table, plan_rows, saved, advice)


def _predictions(results: dict[str, Any], naive: dict[str, float],
                 summary: pd.DataFrame) -> dict[str, tuple[float, str]]:
    """Seconds each fix should save, stated from the experiments before the run's numbers."""
    out = {}
    pull = median_seconds(results.get("storage"), method="boto3_default")
    hit = median_seconds(results.get("storage"), method="land", cache_state="hit")
    if pull is not None and hit is not None:
        out["fetch_data"] = (pull - hit, f"storage: pull {pull:.3g} s - land hit {hit:.3g} s")
    fresh = median_seconds(results.get("model_load"), scenario="fresh", part="load_model")
    cached = median_seconds(results.get("model_load"), scenario="cached", part="load_model")
    if fresh is not None and cached is not None:
        out["load_model"] = (fresh - cached,
                             f"model_load: fresh {fresh:.3g} s - cached {cached:.3g} s")
    rows = summary.set_index("plan")
    if {"naive", "optimized"} <= set(rows.index) and "train" in naive:
        # packing alone: the steady steps shrink with the token slots they carry
        ratio = rows.at["optimized", "token_slots"] / rows.at["naive", "token_slots"]
        why = (f"packing: token slots x{ratio:.3g} of naive (padding "
               f"{rows.at['naive', 'padding_share']:.0%})")
        speed = _micro_speedup(results.get("accum"), int(rows.at["naive", "micro_batch"]),
                               int(rows.at["optimized", "micro_batch"]))
        if speed is not None:
            ratio /= speed
            why += f"; accum sweep: micro-batch {int(rows.at['optimized', 'micro_batch'])} " \
                   f"{speed:.3g}x the tokens/s of {int(rows.at['naive', 'micro_batch'])}"
        else:
            why += ", the same cost per slot assumed (no accum frame)"
        ckpt = _checkpointing_factor(results.get("checkpointing"),
                                     bool(rows.at["naive", "gradient_checkpointing"]),
                                     bool(rows.at["optimized", "gradient_checkpointing"]))
        if ckpt is not None:
            ratio *= ckpt
            why += f"; checkpointing measured: optimized's setting {ckpt:.3g}x naive's per step"
        out["train"] = (naive["train"] * (1 - ratio), why)
        if "warmup" in naive:  # the warm-up steps are steps too: the same fixes shrink them
            out["warmup"] = (naive["warmup"] * (1 - ratio),
                             f"the warm-up steps scale as the steady ones: {why}")
    return out


def _checkpointing_factor(frame: Any, naive_on: bool, opt_on: bool) -> float | None:
    """Step seconds at the optimized plan's checkpointing over the naive's (None if unmeasured)."""
    on, off = (median_seconds(frame, gradient_checkpointing=v) for v in (True, False))
    if on is None or off is None:
        return None
    return (on if opt_on else off) / (on if naive_on else off)


def _micro_speedup(accum: Any, naive_micro: int, micro: int) -> float | None:
    """tokens/s at micro over tokens/s at naive_micro, from the accum sweep (None if absent)."""
    accum = getattr(accum, "frame", accum)
    if accum is None or getattr(accum, "empty", True) or "tokens_per_s" not in accum.columns:
        return None
    ok = accum[accum["status"] == "ok"] if "status" in accum.columns else accum
    speed = ok.groupby("micro_batch")["tokens_per_s"].median()
    if speed.empty:
        return None
    # the job's micro-batch divides its rows per step, so it may fall between the sweep's
    # points: the nearest measured point (in ratio) stands for it
    def near(m: int) -> Any:
        return min(speed.index, key=lambda p: abs(math.log(p / m)))

    return float(speed[near(micro)] / speed[near(naive_micro)])


def savings(table: pd.DataFrame, results: dict[str, Any], summary: pd.DataFrame) -> pd.DataFrame:
    """Per run-level stage: predicted vs measured saving of optimized over naive."""
    import pandas as pd

    cols = ["stage", "finding", "predicted_s", "measured_s", "error_share", "flagged", "evidence"]
    runs = set(table["run"])
    if not {"naive", "optimized"} <= runs:
        return pd.DataFrame(columns=cols)
    run_level = table.assign(stage=table["stage"].where(table["level"] == "run", "train"))
    per = run_level.groupby(["run", "stage"])["seconds"].sum()
    naive, opt = per["naive"].to_dict(), per["optimized"].to_dict()
    predicted = _predictions(results, naive, summary)
    rows = []
    for stage in FIXES:
        if stage not in naive and stage not in opt:
            continue
        measured = naive.get(stage, 0.0) - opt.get(stage, 0.0)
        pred, why = predicted.get(stage, (None, "no experiment frame predicts this stage"))
        err = abs(measured - pred) / abs(pred) if pred else None
        rows.append({"stage": stage, "finding": FIXES[stage], "predicted_s": pred,
                     "measured_s": measured, "error_share": err,
                     "flagged": bool(err is not None and err > PREDICTION_TOLERANCE),
                     "evidence": f"naive {naive.get(stage, 0.0):.3g} s -> optimized "
                                 f"{opt.get(stage, 0.0):.3g} s; predicted from {why}"})
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values("measured_s", ascending=False, ignore_index=True)
