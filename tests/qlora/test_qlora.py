"""The QLoRA job end to end on CPU (tiny nf4 Llama, embedded S3 and hub), and its plans."""

from __future__ import annotations

import math
import re

import pytest

from diag.config import QLoraConfig
from diag.qlora import Plan

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


# its module fixture is made once: the file's tests share one xdist worker (make test)
pytestmark = [pytest.mark.xdist_group("test_qlora"), pytest.mark.slow]  # trains the job: ~30 s


@pytest.fixture(scope="module")
def counted():
    """The comparison, and the checkpointing setting of every 4-bit base it loaded."""
    from diag.qlora import base, run_qlora

    loads, load = [], base.load_base
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(base, "load_base", lambda plan, *more: loads.append(
            plan.gradient_checkpointing) or load(plan, *more))
        # seq_len 128: two of the embedded records (38 to 93 tokens) fit a window; at the quick
        # 96 few pairs do, and whole records packed save nothing there
        # exactly 2 rounds: no budget for more while the headline is unresolved
        return run_qlora(QLoraConfig.quick(rounds=2, seq_len=128), budget_s=0.0), loads


@pytest.fixture(scope="module")
def both(counted):
    return counted[0]


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
    # the pipeline is a measured decision: either outcome, with what it must do
    pipeline = both.plans.set_index(["run", "setting"]).loc[("optimized", "pipeline")]
    assert pipeline["value"] == rows.at["optimized", "pipeline"]
    if pipeline["value"] == "packed":  # resolved faster per token, or the labelled default
        assert rows.at["optimized", "padding_share"] < rows.at["naive", "padding_share"]
        assert rows.at["optimized", "token_slots"] < rows.at["naive", "token_slots"]
        assert "token cache hit" in rows.at["optimized", "data"]
    else:  # within noise on this machine: the naive pipeline kept, it pads alike, and says so
        assert "within noise" in pipeline["evidence"]
        for column in ("padding_share", "token_slots", "data"):
            assert rows.at["optimized", column] == rows.at["naive", column]
    assert rows["final_loss"].map(math.isfinite).all()
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


def test_rounds_interleaved_with_median_and_spread(both):
    rounds = both.rounds
    # the order alternates per round: naive first, then optimized first
    assert list(zip(rounds["round"], rounds["plan"])) == [
        (0, "naive"), (0, "optimized"), (1, "optimized"), (1, "naive")]
    rows = both.frame.set_index("plan")
    assert (rows["rounds"] == 2).all()
    assert (rows["seconds_min"] <= rows["seconds"]).all()
    assert (rows["seconds"] <= rows["seconds_max"]).all()
    table = both.comparison.iloc[0]  # the headline's figures, read from the cost table
    assert table["low"] <= table["speedup"] <= table["high"] and table["rounds"] == 2
    assert table["clock"] == "CPU" and not table["resolved"]  # 2 rounds cannot resolve a gap
    assert "per trained token, not resolved in 2 rounds (a gap needs 5" in table["text"]
    # the headline's totals are the waterfall's ends, and its ratio theirs
    flow = both.waterfall.set_index("bar")["seconds"]
    assert (table["naive_s"], table["optimized_s"]) == (flow["naive"], flow["optimized"])
    assert table["speedup"] == pytest.approx(flow["naive"] / flow["optimized"])


def test_the_base_is_loaded_once_per_plan_and_once_per_checkpointing_setting(counted):
    from diag.qlora.base import REUSED

    both, loads = counted
    ran = both.frame.set_index("plan")
    # the decisions' sweeps share one step per checkpointing setting (accum, the loader and
    # checkpointing's off side one, its on side the other); each plan's base is loaded once, by
    # its own step timed before the rounds, and reused by both rounds and by its FLOP count: 4
    # loads, where each sweep, timed step, round and count loading its own made 12
    assert sorted(loads) == sorted([True, False, *ran["gradient_checkpointing"]])
    # every round shows the load its plan's first load measured, and says so
    basis = both.shares.set_index(["run", "stage"])["basis"]
    for plan in ran.index:
        assert basis[(plan, "load_model")] == REUSED
        assert both.shares.set_index(["run", "stage"]).at[(plan, "load_model"), "seconds"] > 0
    # the model_cache fix is checked on the part of the load it sets: each plan's model folder
    # (a download, or the cache), not the load both plans pay alike
    saved = both.savings.set_index("stage")
    assert "its model folder (the part the fix sets)" in saved.at["load_model", "evidence"]
    costs = both.costs[(both.costs["when"] == "runs") & (both.costs["clock"] == "CPU")]
    cost = costs.set_index(["plan", "stage"])["seconds"]
    assert 0 < cost["optimized", "download"] < cost["naive", "download"] < \
        cost["naive", "load_model"]
    assert saved.at["load_model", "measured_s"] == pytest.approx(
        cost["naive", "download"] - cost["optimized", "download"])


def test_a_reused_base_trains_exactly_as_a_fresh_load():
    # the naive plan: checkpointing on, its model downloaded into an empty cache that the
    # second round's tokenizer still reads
    from diag.amdahl import shares
    from diag.qlora.base import REUSED, Bases
    from diag.qlora.job import open_sources, run_plan

    # 3 steps: LoRA's B starts at 0 and the first step's learning rate is 0 (warm-up), so only
    # the third loss depends on the adapter's initialisation
    cfg = QLoraConfig.quick(steps=3, records=6)
    with open_sources(cfg) as src, Bases() as bases:
        fresh, reused = (run_plan(cfg, Plan.naive(), src, bases) for _ in range(2))
    # bit for bit: the adapter's initialisation, the base after the adapter came off (not
    # merged into it, not trained) and the data are those of a fresh load
    assert reused.losses["loss"].tolist() == fresh.losses["loss"].tolist()
    loaded = [r.stages.set_index("stage").loc["load_model"] for r in (fresh, reused)]
    assert "basis" not in loaded[0] and loaded[1]["basis"] == REUSED
    assert loaded[1]["seconds"] == loaded[0]["seconds"] > 0  # round 0's load, never ~0 s
    assert shares(reused.stages).set_index("stage").at["load_model", "basis"] == REUSED
    assert reused.summary["seconds"] > loaded[1]["seconds"]


def test_setup_is_its_own_stage_and_the_stages_add_to_the_trainer_wall(both):
    stages, rows = both.stages, both.frame.set_index("plan")
    for run in ("naive", "optimized"):
        mine = stages[(stages["run"] == run) & stages["step"].isna()]
        assert (mine["stage"] == "setup").sum() == 1
        inside = mine[mine["stage"].isin(["setup", "warmup", "train", "checkpoint"])]
        assert inside["seconds"].sum() == pytest.approx(rows.at[run, "trainer_wall_s"], rel=0.03)


def test_savings_and_advice(both):
    saved = both.savings.set_index("stage")
    # every run-level stage is checked: the fixed ones predicted from each plan's starts and
    # own step timed before the runs, the set-up (no setting changes it) at 0 s; on this CPU
    # all on the comparison's one clock, CPU seconds
    assert set(saved.index) == {"fetch_data", "load_model", "preprocess", "setup", "warmup",
                                "train"}
    assert saved["predicted_s"].notna().all() and saved["error_share"].notna().all()
    assert (saved["clock"] == "CPU").all()
    assert "fetch pull -> land" in saved.at["fetch_data", "finding"]
    assert saved.at["setup", "predicted_s"] == 0.0 and saved.at["setup", "finding"] == "unchanged"
    # the step stages: whether the runs met the naive step timed before them, in words
    for stage in ("warmup", "train"):
        assert "timed before them: " in saved.at[stage, "evidence"]
        assert re.search(r"\d+ \+ 2 samples, spread", saved.at[stage, "evidence"])
    # measured: the runs' costs at their own counts, on the clock compared
    costs = both.costs[(both.costs["when"] == "runs") & (both.costs["clock"] == "CPU")]
    train = costs[costs["stage"] == "train"].set_index("plan")["seconds"]
    slots = both.frame.set_index("plan")
    steady = {p: (slots.at[p, "steps"] - slots.at[p, "warmup_steps"]) * slots.at[p, "token_slots"]
              / slots.at[p, "steps"] for p in ("naive", "optimized")}
    assert saved.at["train", "measured_s"] == pytest.approx(
        train["naive"] * steady["naive"] - train["optimized"] * steady["optimized"])
    # the micro-batch is measured on the job: on 2 busy cores 1 and 3 rows can come out near a
    # tie either way, so the finding names it exactly when the plan changed it
    micro = both.frame.set_index("plan").at["optimized", "micro_batch"]
    assert ("micro_batch 1 -> " in saved.at["train", "finding"]) == (micro != 1), micro
    assert list(both.advice.columns) == ["stage", "finding", "seconds_saved", "evidence"]
    assert "setup" not in set(both.advice["stage"])  # no fix: no advice
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
    # qlora_plans (what is printed) against the run's own summary, read back from what ran:
    # the DataLoader the Trainer iterated (batch size, workers, pinning, the dataset it served),
    # the model's checkpointing, never copied from the plan
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
    ("rounds", 0, "rounds"), ("rounds", 2.5, "rounds"),
])
def test_bad_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        QLoraConfig.quick(**{field: value})


def test_qlora_step_times_checkpointing_on_and_off():
    import torch

    from diag.embedded import ensure_assets
    from diag.qlora.measure import JobInputs, checkpointing_on_job

    assets = ensure_assets()
    job = JobInputs(2, assets.model_dir, assets.dataset, torch.device("cpu"))
    got = checkpointing_on_job(QLoraConfig.quick(sweep_steps=1, decide_budget_s=0), job, micro=2)
    frame = got.frame
    screen = frame[frame["repeat"] == 0]
    assert list(screen["gradient_checkpointing"]) == [True, False] * 2  # alternated
    # at the naive plan's micro-batch (its step's own on/off ratio) and at the plan's
    assert list(screen["micro_batch"]) == [1, 1, 2, 2] and (frame["seconds"] > 0).all()
    # a screen of one step is topped up to the five samples a side a gap can resolve with
    assert frame.groupby(["micro_batch", "gradient_checkpointing"]).size().min() >= 5
    # the step's own memory: what autograd saved plus the adapters' state, megabytes (at
    # micro 2, seq 96: ~5 MB saved), not the process's resident set; off saves more than on
    peak = frame.groupby(["micro_batch", "gradient_checkpointing"])["peak_mem_gb"].max()
    assert 0.002 < peak[(2, False)] < 0.05 and peak[(2, True)] < peak[(2, False)]
    assert peak[(1, False)] < peak[(2, False)]
    (decision,) = got.decisions
    assert decision.setting == "gradient_checkpointing"
    assert decision.measured_on.seq_len == 96 and "LoRA" in decision.measured_on.model
    assert decision.samples[0] >= 5 and "samples" in decision.why
    if decision.basis == "measured":  # else on measured faster than off: said, not priced
        # priced on the clock it compared: this CPU's seconds
        at_two = frame[frame["micro_batch"] == 2].groupby("gradient_checkpointing")["cpu_s"]
        assert decision.baseline_s == at_two.median()[True] and decision.clock == "CPU"


def test_each_plan_has_its_mfu_by_both_flop_counts_and_the_report_says_it(both, tmp_path):
    from diag import report
    from diag.frames import frames_of
    from diag.mfu.qlora import EXECUTED
    from diag.report.units import cell

    mfu = both.mfu  # what `diag qlora` prints as qlora_mfu
    assert list(mfu["plan"]) == ["naive", "naive", "optimized", "optimized"]
    executed, model = mfu[mfu["flops"] == EXECUTED], mfu[mfu["flops"] != EXECUTED]
    assert model["flops"].str.startswith("model FLOPs ").all()
    # what runs is less than the convention counts (no frozen weight gradients), and the
    # counter (with the 4-bit forward added back) sees just what runs
    assert (model["flops_per_token"].values > 1.3 * executed["flops_per_token"].values).all()
    assert executed["counter_vs_flops"].between(0.95, 1.05).all()
    # on CPU the peak is the probes' of the precisions the step ran in, their spread shown
    # an MFU is in (0, 1), or it is no figure and says why with both numbers (never > 100%)
    shown_ok = mfu["mfu"].between(0, 1, inclusive="neither")
    assert (shown_ok | (mfu["mfu"].isna() & mfu["peak"].str.startswith("not an MFU: "))).all()
    assert (mfu["achieved_tflops"] > 0).all() and (mfu["peak_tflops"] > 0).all()
    assert mfu["peak"].str.contains("measured: CPU bf16 matmul probe").all()
    assert mfu["peak"].str.contains("per CPU second").all()
    assert mfu["peak"].str.contains("measured: CPU fp32 matmul probe").all()
    assert (mfu["peak_spread"] >= 0).all()
    page = (report.write(frames_of("qlora", both), tmp_path / "r") / "report.html").read_text()
    shown = {r.plan: cell("mfu", r.mfu) for r in executed.itertuples()}
    assert (f"MFU of the steady steps, by the FLOPs they ran: naive <b>{shown['naive']}</b>, "
            f"optimized <b>{shown['optimized']}</b>") in page
    assert "by the model-FLOPs convention " in page and "the glossary" in page


def test_the_job_times_its_own_starts_only_where_no_decision_priced_them():
    import dataclasses

    from diag.decision import Decision
    from diag.qlora.job import open_sources, prepare
    from diag.qlora.experiment import time_starts

    cfg = QLoraConfig.quick(rounds=2)
    opt = Plan.optimized().for_device("cpu").fit(4)
    fetch = Decision.from_rows("fetch", "land", "storage", [{"x": 1}], source="storage",
                               baseline="pull", stage="fetch_data", per="start",
                               baseline_s=9.0, chosen_s=1.0, clock="CPU")
    priced = dataclasses.replace(opt, decisions=tuple(
        fetch if d.setting == "fetch" else d for d in opt.decisions))
    with open_sources(cfg) as src:
        prepare(cfg, opt, src)
        timed = time_starts(cfg, [Plan.naive(), opt], src, "CPU")
        assert set(timed["stage"]) == {"fetch_data", "download", "preprocess"}
        assert set(timed["when"]) == {"before"} and set(timed["clock"]) == {"wall", "CPU"}
        # downloading into an empty cache costs more than finding the persistent copy; the
        # model folder is timed by the first round alone (a download: the same bytes a start)
        folder = timed[(timed["stage"] == "download") & (timed["clock"] == "CPU")]
        cost = folder.set_index("plan")["seconds"]
        assert len(folder) == 2 and cost["naive"] > cost["optimized"] > 0
        assert (timed[timed["stage"] == "fetch_data"].groupby("plan").size() == 4).all()
        # storage measured the fetch on this clock: its seconds, not timed again (no pull)
        again = time_starts(cfg.replace(rounds=1), [Plan.naive(), priced], src, "CPU")
        fetched = again[again["stage"] == "fetch_data"].set_index("plan")["seconds"]
        assert fetched.to_dict() == {"naive": 9.0, "optimized": 1.0}
        assert "the storage decision's" in again.loc[again["stage"] == "fetch_data",
                                                     "evidence"].iloc[0]
        # a decision on another clock prices nothing here: timed again
        wall = time_starts(cfg.replace(rounds=1), [Plan.naive(), priced], src, "wall")
        assert 9.0 not in set(wall["seconds"])


def test_the_summary_is_read_back_from_what_ran(monkeypatch):
    # the Trainer's loader made to ignore the plan's workers, and the model's checkpointing
    # turned off behind the plan (as a library default could): the summary says what ran
    import dataclasses

    from diag.qlora import base, trainer
    from diag.qlora.job import open_sources, prepare, run_plan

    made, load = trainer.training_args, base.load_model
    monkeypatch.setattr(trainer, "training_args", lambda *a, **k: made(*a, **k | {
        "dataloader_num_workers": 0, "dataloader_persistent_workers": False,
        "dataloader_prefetch_factor": None}))

    def loaded(*args):
        model = load(*args)
        model.gradient_checkpointing_disable()
        return model

    monkeypatch.setattr(base, "load_model", loaded)
    cfg = QLoraConfig.quick(steps=2, records=4)
    plan = dataclasses.replace(Plan.optimized().for_device("cpu"), num_workers=1, micro_batch=2,
                               persistent_workers=True, prefetch_factor=2,
                               gradient_checkpointing=True)
    with open_sources(cfg) as src:
        prepare(cfg, plan, src)
        got = run_plan(cfg, plan, src).summary
    assert (got["num_workers"], got["micro_batch"], got["pipeline"]) == (0, 2, "packed")
    assert got["gradient_checkpointing"] is False
