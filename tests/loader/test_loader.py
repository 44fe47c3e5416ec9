"""The loader experiment: the sweep finds a known per-sample cost; faults; run_loader's frames."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from diag.config import LoaderConfig
from diag.data import PackedDataset, build_token_cache
from diag.embedded import ensure_assets, synthetic_records
from diag.loader.advice import advice, decide, recommend
from diag.loader import profile_lines
from diag.loader.toy import EmulatedStep, gpu_step_seconds, measure_model_step
from diag.loader.sweep import (Guarded, Setting, measure_setting, records_needed, sweep_workers,
                               usable_cores)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> PackedDataset:
    tok = ensure_assets().model_dir
    cache = build_token_cache(list(synthetic_records(400)), tok,
                              cache_dir=tmp_path_factory.mktemp("tokens"))
    return PackedDataset(cache.folder, seq_len=64)


@pytest.mark.slow
def test_sweep_recovers_an_injected_per_sample_cost_and_recommends_the_workers_it_needs():
    # 250 ms per sample x 2 samples = 500 ms a batch against a 375 ms step: one worker is too
    # slow (waits ~125 ms a step), two make a batch every 250 ms and keep up with 125 ms to
    # spare. Each figure's floor is a sleep, which a load never shortens; above it a loaded
    # 2-core box's late wake-ups and hand-offs add a few ms a step (~6 ms seen), far from what
    # each check separates. The sweep stops at two workers, the fewest that keep up: beside a
    # third, which of the two hands a batch over a millisecond sooner is a load's coin toss,
    # and the near-best rule would then decide by it (the rule's own tests use fixed frames).
    cfg = LoaderConfig.quick(pipelines=["packed"], workers=[0, 1, 2], batch_size=2,
                             seq_len=64, steps=4, extra_prep_ms=250.0, step_ms=375.0)
    sweep = sweep_workers(cfg)
    assert list(sweep["num_workers"]) == [0, 1, 2] and (sweep["error"] == "").all()
    rec = recommend(sweep, cfg.target_share).iloc[0]
    assert 250.0 <= rec["per_sample_ms"] <= 250.0 * 1.10
    assert rec["workers_needed"] == 2
    # the workers rule: 2 under the 2% goal, or (a loaded machine's late wake-ups leave the
    # hand-off above it) the smallest within 10% / 1 ms of the best, which 2 is: 2 either way;
    # one repeat a setting is one sample a side, which never resolves: 0 is kept, said so
    decided = {d.setting: d for d in decide(sweep)}["num_workers"]
    assert decided.value == 0 and "0 workers kept: 2 would be picked" in decided.why, (
        decided.why, sweep[["num_workers", "data_wait_share"]])
    assert "within noise" in decided.why and "1 + 1 samples" in decided.why
    kept_up = not pd.isna(rec["recommended_workers"])
    assert not kept_up or rec["recommended_workers"] == 2, sweep[["num_workers", "data_wait_share"]]
    by = sweep.set_index("num_workers")
    assert by.loc[1, "data_wait_share"] > 0.15  # (500 - 375) / 500 of each step is a wait
    # two workers hide the cost: what is left is the hand-off, a few ms of a 375 ms step. A
    # busy box delays each of its wake-ups (worker, queue, main) as late as the step's own
    # sleep wakes, which this sweep measured (at load 11-13, 92 ms of wait against 127 at 1)
    late = (by["step_s"] - 0.375).clip(lower=0).max()
    assert by.loc[2, "data_wait_s"] < by.loc[1, "data_wait_s"]
    assert by.loc[2, "data_wait_s"] < 0.25 * by.loc[1, "data_wait_s"] + 3 * late, (late, sweep)
    found = advice(sweep, recommend(sweep), run_steps=100)
    assert found["finding"].str.contains(
        "num_workers=2" if kept_up else "workers alone leave").any()
    row = found.iloc[0]
    saved = (by.loc[0, "data_wait_s"] - by.loc[2, "data_wait_s"]) * 100
    assert row["stage"] == "data_wait" and row["seconds_saved"] == pytest.approx(saved)


def test_a_setting_stops_its_persistent_workers_and_leaves_the_collector_as_it_found_it(packed):
    import gc
    import multiprocessing

    def run() -> None:
        before = set(multiprocessing.active_children())  # another test's are not ours to judge
        rows = measure_setting(Guarded(packed), Setting(2, persistent_workers=True),
                               EmulatedStep(0.001), pipeline="packed", batch_size=4, steps=3,
                               repeats=2)
        assert [r["error"] for r in rows] == ["", ""]
        # the persistent workers are stopped before the next setting forks its own, with no
        # automatic collection to help (disabled below)
        assert set(multiprocessing.active_children()) - before == set()

    assert gc.get_freeze_count() == 0
    gc.disable()  # no automatic pass may free them first
    try:
        run()
        assert gc.get_freeze_count() == 0  # given back
        gc.freeze()  # a caller's own freeze is left alone (its count only drops as frozen
        run()        # objects are freed: never to 0, which an unfreeze on its behalf would give)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_raising_sample_fails_its_setting_with_index_and_message(packed, workers):
    start = time.perf_counter()
    rows = measure_setting(Guarded(packed, fail_at=9), Setting(workers), EmulatedStep(0.001),
                           pipeline="packed", batch_size=4, steps=6, timeout_s=30)
    assert time.perf_counter() - start < 20  # surfaced, not hung
    assert len(rows) == 1 and rows[0]["error"] == (
        "SampleError: sample 9: ValueError: injected fault at sample 9")
    ok = measure_setting(Guarded(packed), Setting(1), EmulatedStep(0.001), pipeline="packed",
                         batch_size=4, steps=3)  # the sweep goes on with the next setting
    import pandas as pd

    assert ok[0]["error"] == "" and ok[0]["samples_per_s"] > 0
    rec = recommend(pd.DataFrame([*rows, *ok]).assign(cores=2)).iloc[0]
    assert rec["failed_workers"] == str(workers)  # listed, and left out of the recommendation


def test_more_workers_than_cores_is_allowed_with_a_warning(packed):
    w = usable_cores() + 1
    row = measure_setting(packed, Setting(w), EmulatedStep(0.001), pipeline="packed",
                          batch_size=2, steps=2)[0]
    assert row["error"] == "" and row["samples_per_s"] > 0
    assert row["warning"].startswith(f"num_workers={w} > {usable_cores()} usable cores")


@pytest.mark.parametrize("field,value", [("workers", [0, -1]), ("workers", []),
                                         ("batch_size", 0), ("seq_len", 1), ("steps", 2.5),
                                         ("step_ms", -1.0), ("prefetch_factor", 0),
                                         ("pipelines", ["fast"]), ("consumer", "gpu"),
                                         ("on_error", "ignore"), ("target_share", 1.0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LoaderConfig.{field}="):
        LoaderConfig(**{field: value})


def test_malformed_jsonl_is_counted_or_stops_as_configured(tmp_path: Path):
    data = tmp_path / "d.jsonl"
    good = [json.dumps(r) for r in synthetic_records(40)]
    data.write_text("\n".join(good[:10] + ["{not json", '{"instruction": "x"}'] + good[10:]))
    cfg = LoaderConfig.quick(data=str(data), tokenizer=str(ensure_assets().model_dir),
                             workers=[0], steps=2, step_ms=1.0)
    sweep = sweep_workers(cfg)
    # each pipeline reads the records the sweep draws (30, the line profile's), and the bad
    # rows among them
    assert set(sweep["bad_rows"]) == {2} and set(sweep["records"]) == {records_needed(cfg)} \
        == {30}
    with pytest.raises(ValueError, match="line 11: invalid_json"):
        sweep_workers(cfg.replace(on_error="raise"))


def test_step_from_the_gpu_table_and_measured_here():
    # 6 x 1.1e9 params x 8192 tokens / (989.5 TFLOP/s dense bf16 x 0.4)
    assert gpu_step_seconds("H100 SXM", 1.1, 16 * 512, 0.4) == pytest.approx(0.1366, rel=0.01)
    with pytest.raises(ValueError, match="LoaderConfig.gpu='TPU'"):
        gpu_step_seconds("TPU", 1.1, 8192, 0.4)
    seconds = measure_model_step(ensure_assets().model_dir, torch.device("cpu"), 2, 16,
                                 warmup=1, repeats=1)
    assert 0 < seconds < 30


def _slow_then_fast(n: int) -> int:
    time.sleep(0.004)
    total = n + 1
    return total


def test_profile_lines_finds_the_hot_line():
    lines = profile_lines(_slow_then_fast, range(20))
    assert list(lines["hits"]) == [20, 20, 20]
    hot = lines.loc[lines["seconds"].idxmax()]
    assert hot["source"] == "time.sleep(0.004)" and hot["share"] > 0.9
    assert lines["share"].sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="Python function"):
        profile_lines(len, [[1]])


@pytest.mark.slow
def test_run_loader_quick_gives_every_frame():
    from diag.loader import run_loader

    got = run_loader(LoaderConfig.quick(step_ms=5.0))
    assert set(got.sweep["pipeline"]) == {"naive", "packed"}
    assert set(got.sweep["num_workers"]) == {0, 1, 2} and (got.sweep["first_batch_s"] > 0).all()
    assert list(got.stalls["pipeline"]) == ["naive", "packed"]
    assert (got.stalls[["prep_stall_s", "fetch_stall_s"]] >= 0).all().all()
    assert got.stalls["cache_state"].str.len().gt(0).all()
    sources = " ".join(got.lines["source"])
    assert 'prompt_ids = tokenizer(prompt, ' in sources  # the naive per-sample encoding
    assert list(got.recommendation["pipeline"]) == ["naive", "packed"]
    assert got.recommendation["verdict"].str.len().gt(0).all()
    assert list(got.advice.columns) == ["stage", "finding", "seconds_saved", "evidence"]
    from diag.plots import plot_loader

    ax = plot_loader(got.sweep).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["naive", "packed", "target 2%"]


def test_cli_loader_prints_every_table_as_json_and_workers_is_an_alias(capsys):
    from diag.cli import main

    code = main(["loader", "--quick", "--pipelines", "packed", "--workers", "0,1", "--steps", "2",
                 "--step-ms", "2", "--profile-samples", "3", "--json"])
    assert code == 0
    tables = json.loads(capsys.readouterr().out)
    assert set(tables) == {"loader", "loader_stalls", "loader_lines", "loader_recommendation",
                           "advice", "decisions"}
    assert [r["num_workers"] for r in tables["loader"]] == [0, 1]
    decided = {r["setting"]: r for r in tables["decisions"]}
    assert decided["num_workers"]["basis"] == "measured"
    assert decided["prefetch_factor"]["basis"] == "default"  # the sweep never varied it
    assert main(["loader", "--quick", "--workers", "0,-1"]) == 2  # one line, names the field
    assert "LoaderConfig.workers=[0, -1]" in capsys.readouterr().err


def test_sweep_with_the_real_model_step_as_consumer():
    cfg = LoaderConfig.quick(consumer="model", pipelines=["packed"], workers=[0], batch_size=2,
                             seq_len=32, steps=1, device="cpu")
    sweep = sweep_workers(cfg)
    row = sweep.iloc[0]
    assert row["error"] == "" and row["consumer"] == "model" and row["step_s"] > 0
    assert row["step_source"].startswith("the model in ")  # no emulated duration was used


class _Counted(EmulatedStep):
    """An emulated step that counts the calls that held the loop."""

    held = 0

    def __call__(self, batch):
        type(self).held += 1
        return super().__call__(batch)


@pytest.mark.parametrize("workers", [0, 1])
def test_stall_split_accounts_an_emulated_step_it_cannot_overlap(workers):
    # num_workers=0 makes each batch between steps in this process: a step's length cannot
    # change the wait, so the split accounts the emulated step at its seconds without sleeping
    # it; with a worker the batch is made while the step runs, so the step is really held
    from diag.loader import stall_split

    _Counted.held = 0
    cfg = LoaderConfig.quick(pipelines=["packed"], workers=[workers], steps=2, seq_len=64)
    got = stall_split(cfg, step=_Counted(0.05)).iloc[0]
    assert got["num_workers"] == workers and got["error"] == ""
    if workers == 0:
        assert _Counted.held == 0 and got["step_s"] == 0.05
    else:
        assert _Counted.held > 0 and got["step_s"] >= 0.05
