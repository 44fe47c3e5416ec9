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

    return run_qlora(QLoraConfig.quick())


def test_both_plans_train_the_same_records(both):
    rows = both.frame.set_index("plan")
    assert list(rows.index) == ["naive", "optimized"]
    assert (rows["steps"] == 3).all() and (rows["records"] == 12).all()
    assert rows.at["naive", "micro_batch"] == 1 and rows.at["naive", "grad_accum"] == 4
    assert rows.at["optimized", "grad_accum"] * rows.at["optimized", "micro_batch"] > 1
    # the same tokens in both plans: what one trains plus what it leaves out (naive truncates
    # at seq_len, packed drops the tail rows that make no whole step, under steps rows)
    total = rows["real_tokens"] + rows["left_out_tokens"]
    assert total["naive"] == total["optimized"]
    assert rows.at["optimized", "left_out_tokens"] < 3 * 96
    assert rows.at["naive", "padding_share"] > 0.2
    assert rows.at["optimized", "padding_share"] < rows.at["naive", "padding_share"]
    assert rows.at["optimized", "token_slots"] < rows.at["naive", "token_slots"]
    assert rows["final_loss"].map(math.isfinite).all()
    assert "token cache hit" in rows.at["optimized", "data"]
    assert rows.at["optimized", "once_s"] > 0 and rows.at["naive", "once_s"] == 0
    assert bool(rows.at["naive", "gradient_checkpointing"])
    # the optimized plan's checkpointing is what the on/off timing on the job decided
    ckpt = both.plans.set_index(["run", "setting"]).loc[("optimized", "gradient_checkpointing")]
    assert ckpt["basis"] == "measured"
    assert ckpt["value"] == str(bool(rows.at["optimized", "gradient_checkpointing"]))
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


def test_savings_and_advice(both):
    saved = both.savings.set_index("stage")
    assert {"fetch_data", "load_model", "preprocess", "train"} <= set(saved.index)
    # packing's prediction is stated from the token slots; fetch/load have no frame here
    assert saved.at["train", "predicted_s"] > 0
    assert math.isnan(saved.at["fetch_data", "predicted_s"])
    assert "no experiment frame" in saved.at["fetch_data", "evidence"]
    assert list(both.advice.columns) == ["stage", "finding", "seconds_saved", "evidence"]
    plans = both.plans
    evidence = plans.loc[plans["run"] == "optimized"].set_index("setting")["evidence"]
    # diag qlora measures on the job; storage and model_load ran nowhere: labelled defaults
    assert evidence["fetch"].startswith("default") and "absent" in evidence["fetch"]
    assert evidence["micro_batch"].startswith("measured on")


def test_nothing_leaks_a_secret(both):
    from diag.secrets import secret_values

    text = "".join(f.to_csv() for f in (both.frame, both.stages, both.plans, both.savings))
    for secret in secret_values():
        assert secret not in text


def test_the_plan_shown_is_the_plan_run(both):
    # qlora_plans (what is printed) against the run's own summary (what the Trainer got)
    shown = both.plans.pivot(index="setting", columns="run", values="value")
    ran = both.frame.set_index("plan")
    for run in ("naive", "optimized"):
        for setting in ("micro_batch", "num_workers", "pin_memory", "pipeline",
                        "gradient_checkpointing"):
            assert shown.at[setting, run] == str(ran.at[run, setting]), (run, setting)
    basis = both.plans[both.plans.run == "optimized"].set_index("setting")["basis"]
    # measured on the job itself (diag qlora without --results)
    assert (basis[["micro_batch", "num_workers", "gradient_checkpointing"]] != "default").all()
    assert "the QLoRA step" in both.plans.set_index(["run", "setting"]).at[
        ("optimized", "micro_batch"), "evidence"]


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
    from diag.qlora import savings

    summary = both.frame.assign(micro_batch=[1, 2])  # as if the job had decided 2
    micro = 2
    naive = both.shares[both.shares["run"] == "naive"].set_index("stage")["seconds"]
    storage = pd.DataFrame({"method": ["boto3_default", "land"], "cache_state": ["cold", "hit"],
                            "seconds": [naive["fetch_data"] + 100.0, 0.0]})  # a wild prediction
    accum = pd.DataFrame({"micro_batch": [1, micro], "tokens_per_s": [100.0, 300.0],
                          "status": ["ok", "ok"]})
    table = savings(both.shares, {"storage": storage, "accum": accum}, summary)
    table = table.set_index("stage")
    assert table.at["fetch_data", "predicted_s"] == pytest.approx(100.0 + naive["fetch_data"])
    assert bool(table.at["fetch_data", "flagged"])  # measured is far below: flagged, not hidden
    assert "accum sweep" in table.at["train", "evidence"] and "3x" in table.at["train", "evidence"]
    assert table["measured_s"].notna().all()


def test_train_prediction_prices_the_measured_checkpointing(both):
    from diag.qlora import savings

    rows = both.frame.set_index("plan")
    assert rows.at["naive", "gradient_checkpointing"]
    assert not rows.at["optimized", "gradient_checkpointing"]
    ckpt = pd.DataFrame({"gradient_checkpointing": [True, False], "seconds": [2.0, 1.0]})
    plain = savings(both.shares, {}, both.frame).set_index("stage")
    priced = savings(both.shares, {"checkpointing": ckpt}, both.frame).set_index("stage")
    assert "checkpointing measured: optimized's setting 0.5x" in priced.at["train", "evidence"]
    naive_train = plain.at["train", "predicted_s"] / (1 - float(
        plain.at["train", "evidence"].split("token slots x")[1].split(" ")[0]))
    # half the step cost on top of packing: the predicted saving grows accordingly
    assert priced.at["train", "predicted_s"] > plain.at["train", "predicted_s"]
    assert naive_train > priced.at["train", "predicted_s"]


def test_qlora_step_times_checkpointing_on_and_off():
    import torch

    from diag.accum.sweep import PeakMemory
    from diag.embedded import ensure_assets
    from diag.qlora.measure import JobInputs, checkpointing_on_job

    assets = ensure_assets()
    job = JobInputs(2, assets.model_dir, assets.dataset, torch.device("cpu"))
    got = checkpointing_on_job(QLoraConfig.quick(sweep_steps=1), job, micro=2)
    frame = got.frame
    assert list(frame["gradient_checkpointing"]) == [True, False]  # alternated
    assert (frame["seconds"] > 0).all() and (frame["micro_batch"] == 2).all()
    # the step's own peak (growth during it), far below the interpreter's resident set
    rss = PeakMemory._status_gb("VmRSS:")
    assert (frame["peak_mem_gb"] >= 0).all() and frame["peak_mem_gb"].max() < rss / 4
    (decision,) = got.decisions
    assert decision.setting == "gradient_checkpointing" and decision.basis == "measured"
    assert decision.measured_on.seq_len == 96 and "LoRA" in decision.measured_on.model
