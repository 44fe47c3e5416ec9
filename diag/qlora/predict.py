"""Predictions of each fix's saving, stated before the run from the experiments' evidence.

Moved out of diag.qlora.experiment so the prediction and its check have one home.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from diag.decision import PREDICTION_TOLERANCE
from diag.timing import median_seconds

if TYPE_CHECKING:
    import pandas as pd

FIXES = {
    "fetch_data": "land the dataset once (diag.storage.land) instead of pulling it every start",
    "load_model": "load the base from a persistent HF cache instead of downloading it",
    "preprocess": "tokenize once into a cached, packed token file",
    "warmup": "fewer, larger steps start faster (micro-batch, workers started once)",
    "train": "larger micro-batch, packed rows (no padding), checkpointing off with headroom, "
             "DataLoader workers",
    "checkpoint": "fewer, smaller checkpoints (the LoRA adapter only is small)",
}


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
