"""The QLoRA job end to end on CPU (tiny nf4 Llama, embedded S3 and hub), and its plans."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from diag.config import QLoraConfig
from diag.qlora import Plan

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def both():
    from diag.qlora import run_qlora

    return run_qlora(QLoraConfig.quick(rounds=2))


def test_both_plans_train_the_same_records(both):
    rows = both.frame.set_index("plan")
    assert list(rows.index) == ["naive", "optimized"]
    assert (rows["steps"] == 3).all() and (rows["records"] == 12).all()
    assert rows.at["naive", "micro_batch"] == 1 and rows.at["naive", "grad_accum"] == 4
    assert rows.at["optimized", "grad_accum"] * rows.at["optimized", "micro_batch"] > 1
    # the same tokens trained in both plans: packed pads its tail up to whole steps rather
    # than dropping it, and no record here is cut by seq_len
    assert (rows["left_out_tokens"] == 0).all()
    assert rows.at["naive", "real_tokens"] == rows.at["optimized", "real_tokens"]
    assert rows.at["naive", "loss_tokens"] == rows.at["optimized", "loss_tokens"]
    assert rows.at["naive", "padding_share"] > 0.2
    assert rows.at["optimized", "padding_share"] < rows.at["naive", "padding_share"]
    assert rows.at["optimized", "token_slots"] < rows.at["naive", "token_slots"]
    assert rows["final_loss"].map(math.isfinite).all()
    assert "token cache hit" in rows.at["optimized", "data"]
    assert rows.at["optimized", "once_s"] > 0 and rows.at["naive", "once_s"] == 0
    assert bool(rows.at["naive", "gradient_checkpointing"])
    assert not bool(rows.at["optimized", "gradient_checkpointing"])
    assert "pin_memory" in rows.at["optimized", "notes"]  # CUDA-only setting asked on CPU


def test_stages_losses_and_shares(both):
    stages = both.stages
    for run in ("naive", "optimized"):
        got = set(stages.loc[stages["run"] == run, "stage"])
        assert {"fetch_data", "load_model", "preprocess", "warmup", "train", "checkpoint",
                "data_wait", "compute"} <= got
    losses = both.losses
    assert losses.groupby("run")["step"].apply(list).to_dict() == {
        "naive": [1, 2, 3], "optimized": [1, 2, 3]}
    # same seed and schedule: the learning rate step by step is identical
    lr = losses.pivot(index="step", columns="run", values="learning_rate")
    assert (lr["naive"] == lr["optimized"]).all()
    shares = both.shares
    assert shares.groupby("run")["share"].sum().round(6).eq(1.0).all()
    total = both.frame.set_index("plan")["seconds"]
    from_shares = shares.groupby("run")["seconds"].sum()
    assert from_shares["naive"] == pytest.approx(total["naive"], rel=1e-6)


def test_rounds_interleaved_with_median_and_spread(both):
    rounds = both.rounds
    # the order alternates per round: naive first, then optimized first
    assert list(zip(rounds["round"], rounds["plan"])) == [
        (0, "naive"), (0, "optimized"), (1, "optimized"), (1, "naive")]
    rows = both.frame.set_index("plan")
    assert (rows["rounds"] == 2).all()
    assert (rows["seconds_min"] <= rows["seconds"]).all()
    assert (rows["seconds"] <= rows["seconds_max"]).all()
    line = both.headline
    assert "per trained token" in line and "2 interleaved rounds" in line
    assert f"naive {int(rows.at['naive', 'real_tokens'])}" in line and "once" in line
    assert rows.at["optimized", "check_s"] > 0  # the one-time costs shown, never dropped


def test_setup_is_its_own_stage_and_the_stages_add_to_the_trainer_wall(both):
    stages, rows = both.stages, both.frame.set_index("plan")
    for run in ("naive", "optimized"):
        mine = stages[(stages["run"] == run) & stages["step"].isna()]
        assert (mine["stage"] == "setup").sum() == 1
        inside = mine[mine["stage"].isin(["setup", "warmup", "train", "checkpoint"])]
        assert inside["seconds"].sum() == pytest.approx(rows.at[run, "trainer_wall_s"], rel=0.03)


def test_savings_and_advice(both):
    saved = both.savings.set_index("stage")
    # the plans differ in fetch, cache, pipeline, workers, micro-batch, checkpointing: every
    # run-level stage they touch is listed; without measured decisions none is invented
    assert {"fetch_data", "load_model", "preprocess", "train"} <= set(saved.index)
    assert saved["predicted_s"].isna().all()
    assert "not predicted" in saved.at["fetch_data", "evidence"]
    assert "fetch pull -> land" in saved.at["fetch_data", "finding"]
    assert list(both.advice.columns) == ["stage", "finding", "seconds_saved", "evidence"]
    plans = both.plans
    evidence = plans.loc[plans["run"] == "optimized"].set_index("setting")["evidence"]
    assert "absent" in evidence["num_workers"] and "absent" in evidence["micro_batch"]


def test_nothing_leaks_a_secret(both):
    from diag.secrets import secret_values

    text = "".join(f.to_csv() for f in (both.frame, both.stages, both.plans, both.savings))
    for secret in secret_values():
        assert secret not in text


def test_optimized_plan_follows_the_measured_frames():
    storage = pd.DataFrame({"method": ["boto3_default", "land", "land"],
                            "cache_state": ["cold", "miss", "hit"], "seconds": [9.0, 9.5, 0.3]})
    model_load = pd.DataFrame({"scenario": ["fresh", "cached"], "part": ["load_model"] * 2,
                               "seconds": [30.0, 3.0]})
    loader = pd.DataFrame({"num_workers": [0, 1, 2, 4], "pin_memory": [False, True, True, True],
                           "persistent_workers": [False, True, True, True],
                           "prefetch_factor": [None, 2, 2, 2], "pipeline": ["optimized"] * 4,
                           "samples_per_s": [10, 20, 30, 31],
                           "data_wait_share": [0.4, 0.05, 0.01, 0.005]})
    accum = pd.DataFrame({"micro_batch": [1, 4, 16, 64], "grad_accum": [64, 16, 4, 1],
                          "tokens_per_s": [100, 300, 500, None], "peak_mem_gb": [1, 2, 6, None],
                          "status": ["ok", "ok", "ok", "oom"]})
    plan = Plan.optimized({"storage": storage, "model_load": model_load, "loader": loader,
                           "accum": accum})
    assert (plan.fetch, plan.model_cache, plan.pipeline) == ("land", "persistent", "packed")
    assert plan.num_workers == 2  # the fewest under 2% data_wait, not the most
    assert plan.micro_batch == 16  # the fastest point that ran; the oom row never wins
    assert not plan.pin_memory and "CPU" in plan.notes[0]
    why = dict(plan.evidence)
    assert "measured" in why["fetch"] and "0.3" in why["fetch"]
    assert "measured" in why["micro_batch"] and "16" in why["micro_batch"]
    # the object store faster than the landed copy: the measurement, not a rule, decides
    slow_disk = storage.assign(seconds=[0.2, 9.5, 0.9])
    assert Plan.optimized({"storage": slow_disk}).fetch == "pull"


def test_naive_plan_is_the_newcomer_defaults():
    plan = Plan.naive()
    assert (plan.fetch, plan.model_cache, plan.pipeline, plan.num_workers, plan.micro_batch) == (
        "pull", "empty", "naive", 0, 1)
    assert plan.gradient_checkpointing


@pytest.mark.parametrize("field, value, match", [
    ("plan", "fast", "plan"), ("records", 0, "records"), ("steps", 50, "steps"),
    ("warmup_steps", 3, "warmup_steps"), ("lora_dropout", 1.0, "lora_dropout"),
    ("on_error", "ignore", "on_error"), ("source", "gs://b/k", "source"),
])
def test_bad_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        QLoraConfig.quick(**{field: value})


def test_every_prediction_is_checked_and_a_miss_is_flagged(both):
    import dataclasses

    from diag.decision import Decision
    from diag.qlora.predict import Counts, predict, savings

    rows = both.frame.set_index("plan")
    naive = both.shares[both.shares["run"] == "naive"].set_index("stage")["seconds"]
    wild = Decision.from_rows("fetch", "land", "pull vs land", [{"x": 1}], source="storage",
                              baseline="pull", stage="fetch_data", per="start",
                              baseline_s=naive["fetch_data"] + 100.0, chosen_s=0.0)
    micro = Decision.from_rows("micro_batch", int(rows.at["optimized", "micro_batch"]), "accum",
                               [{"x": 1}], source="accum", baseline=1, stage="compute",
                               per="step", baseline_s=3.0, chosen_s=1.0)
    opt = Plan.optimized().for_device("cpu")
    opt = dataclasses.replace(opt, decisions=(wild, micro))
    counts = Counts(3, 1, rows["token_slots"].astype(int).to_dict())
    table = savings(both.shares, predict(Plan.naive(), opt, counts)).set_index("stage")
    assert table.at["fetch_data", "predicted_s"] == pytest.approx(100.0 + naive["fetch_data"])
    assert bool(table.at["fetch_data", "flagged"])  # measured is far below: flagged, not hidden
    assert "accum: 1 s / 3 s per step" in table.at["train", "evidence"]
    assert table["measured_s"].notna().all()


def test_loader_choice_reads_tokens_not_samples_and_prefers_the_fewest_workers():
    # the naive pipeline delivers more rows/s, but a packed row holds several records: the
    # real tokens/s decide; and on this machine 0 workers already stay under 2% data_wait
    loader = pd.DataFrame({"pipeline": ["naive", "naive", "packed", "packed"],
                           "num_workers": [0, 2, 0, 2], "pin_memory": [True] * 4,
                           "persistent_workers": [True] * 4, "prefetch_factor": [2] * 4,
                           "samples_per_s": [6.0, 3.5, 3.3, 2.6],
                           "tokens_per_s": [300.0, 180.0, 420.0, 330.0],
                           "data_wait_share": [0.004, 0.025, 0.0002, 0.017]})
    plan = Plan.optimized({"loader": loader})
    assert (plan.pipeline, plan.num_workers, plan.persistent_workers) == ("packed", 0, False)
    assert plan.prefetch_factor is None


def test_default_workers_leave_two_cores_to_the_step(monkeypatch):
    from diag.qlora import plans

    monkeypatch.setattr(plans, "_cores", lambda: 2)
    plan = Plan.optimized()
    assert plan.num_workers == 0 and plan.prefetch_factor is None
    assert "2 usable" in dict(plan.evidence)["num_workers"]
    monkeypatch.setattr(plans, "_cores", lambda: 16)
    assert Plan.optimized().num_workers == plans.DEFAULT_WORKERS


def test_checkpointing_follows_measured_headroom_and_says_its_cost(monkeypatch):
    from diag.qlora import plans

    monkeypatch.setattr(plans, "_memory_gb", lambda device: (10.0, "available host memory"))
    ckpt = pd.DataFrame({"gradient_checkpointing": [True, True, False, False],
                         "seconds": [1.3, 1.3, 1.0, 1.0]})
    accum = pd.DataFrame({"micro_batch": [1, 8], "tokens_per_s": [100.0, 300.0],
                          "peak_mem_gb": [0.5, 2.0], "status": ["ok", "ok"]})
    plan = Plan.optimized({"accum": accum, "checkpointing": ckpt})
    why = dict(plan.evidence)["gradient_checkpointing"]
    assert not plan.gradient_checkpointing and "2 GB of 10 GB" in why and "1.3x" in why
    tight = accum.assign(peak_mem_gb=[0.5, 6.0])  # over half the memory: recompute instead
    assert Plan.optimized({"accum": tight, "checkpointing": ckpt}).gradient_checkpointing


def test_qlora_step_times_checkpointing_on_and_off():
    import torch

    from diag.embedded import ensure_assets
    from diag.qlora.measure import _checkpointing

    frame = _checkpointing(QLoraConfig.quick(), ensure_assets().model_dir, torch.device("cpu"),
                           micro=2, steps=1)
    assert list(frame["gradient_checkpointing"]) == [True, False]  # alternated
    assert (frame["seconds"] > 0).all() and (frame["micro_batch"] == 2).all()
