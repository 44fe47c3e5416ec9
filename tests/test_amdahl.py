import math

import pandas as pd
import pytest

from diag import amdahl
from diag.machine.device import dense_peak_flops


def constructed(run="naive", wait=(0.2, 0.3, 0.2), compute=(1.0, 1.2, 1.0), fetch=30.0, load=10.0):
    """A run with known numbers: 30 s fetch, 10 s load, three steps of data_wait + compute."""
    rows = [{"stage": "fetch_data", "seconds": fetch, "step": pd.NA},
            {"stage": "load_model", "seconds": load, "step": pd.NA},
            {"stage": "train", "seconds": sum(wait) + sum(compute), "step": pd.NA}]
    for i, (w, c) in enumerate(zip(wait, compute)):
        rows += [{"stage": "data_wait", "seconds": w, "step": i},
                 {"stage": "compute", "seconds": c, "step": i}]
    frame = pd.DataFrame(rows)
    frame["step"] = frame["step"].astype("Int64")
    return frame.assign(run=run)


def test_shares_match_hand_computed_values_and_add_up_to_one():
    table = amdahl.shares(constructed()).set_index("stage")
    # step-level: the sum over the 3 measured steps; train itself is shown as its parts
    assert table.loc["data_wait", "seconds"] == pytest.approx(0.2 + 0.3 + 0.2)
    assert table.loc["compute", "seconds"] == pytest.approx(1.0 + 1.2 + 1.0)
    assert "train" not in table.index
    total = 30 + 10 + 0.7 + 3.2
    assert table.loc["fetch_data", "share"] == pytest.approx(30 / total)
    assert table["share"].sum() == pytest.approx(1.0)
    assert table.loc["fetch_data", "basis"].startswith("measured")
    assert table.loc["compute", "level"] == "step"


def test_total_steps_projects_step_stages_and_says_so():
    table = amdahl.shares(constructed(), total_steps=1000).set_index("stage")
    assert table.loc["compute", "seconds"] == pytest.approx(3.2 / 3 * 1000)
    assert table.loc["compute", "basis"].startswith("projected: mean 1.067 s/step x 1000 steps")
    assert table.loc["fetch_data", "seconds"] == 30.0
    assert table["share"].sum() == pytest.approx(1.0)


def test_train_time_outside_step_stages_becomes_other():
    frame = constructed()
    frame.loc[frame["stage"] == "train", "seconds"] += 0.3  # 0.1 s per step unaccounted
    table = amdahl.shares(frame).set_index("stage")
    assert table.loc["other", "seconds"] == pytest.approx(0.3)
    # other is part of the run: the shares still add up to one, other's included
    total = 30 + 10 + 0.7 + 3.2 + 0.3
    assert table["seconds"].sum() == pytest.approx(total)
    assert table.loc["other", "share"] == pytest.approx(0.3 / total)
    assert table["share"].sum() == pytest.approx(1.0, abs=1e-12)
    projected = amdahl.shares(frame, total_steps=300)
    assert projected["share"].sum() == pytest.approx(1.0, abs=1e-12)


def test_runs_are_kept_apart():
    frame = pd.concat([constructed("naive"), constructed("optimized", fetch=0.5, load=2.0)])
    table = amdahl.shares(frame)
    assert list(dict.fromkeys(table["run"])) == ["naive", "optimized"]
    for _, part in table.groupby("run"):
        assert part["share"].sum() == pytest.approx(1.0)


def test_load_parts_alone_make_the_load_model_stage():
    frame = pd.DataFrame({"stage": ["download", "read", "quantize"], "seconds": [3.0, 1.0, 0.5]})
    table = amdahl.shares(frame)
    assert table["stage"].tolist() == ["load_model"]
    assert table["seconds"].iloc[0] == pytest.approx(4.5)


def test_project_with_inf_removes_a_stage():
    out = amdahl.project(constructed(), {"fetch_data": math.inf, "compute": 2.0}).set_index("stage")
    assert out.loc["fetch_data", "seconds_after"] == 0.0
    assert out.loc["compute", "seconds_after"] == pytest.approx(1.6)
    assert out.loc["load_model", "seconds_after"] == 10.0
    assert out.loc["total", "seconds_before"] == pytest.approx(43.9)
    assert out.loc["total", "seconds_after"] == pytest.approx(10 + 0.7 + 1.6)
    assert out.loc["total", "speedup"] == pytest.approx(43.9 / 12.3)


def test_upgrade_uses_the_dense_peak_ratio():
    ratio = dense_peak_flops("H100 SXM") / dense_peak_flops("RTX 4070")
    assert ratio == pytest.approx(989.4 / 58.3)
    assert amdahl.compute_ratio("RTX 4070", "H100 SXM") == pytest.approx(ratio)
    out = amdahl.upgrade(constructed(), "RTX 4070", "H100 SXM").set_index("stage")
    assert out.loc["compute", "speedup"] == pytest.approx(ratio)
    assert out.loc["fetch_data", "seconds_after"] == 30.0  # the GPU does not touch S3
    assert "dense bf16 peak ratio" in out.loc["compute", "assumption"]


def test_inverse_amdahl_worked_example_from_the_seed_story():
    # 11 h on an RTX 4070, 9.5 h on an H100 with a 4.5x compute ratio
    split = amdahl.infer_compute_share(11 * 3600, 9.5 * 3600, 4.5)
    assert split["compute"] / 3600 == pytest.approx(1.93, abs=0.01)
    assert split["not_compute_share"] == pytest.approx(0.82, abs=0.01)
    assert split["compute"] + split["not_compute"] == pytest.approx(11 * 3600)
    # the notebook's call, in hours: C = 1.5 / (1 - 1/4.5) = 27/14 h; every field by hand
    hours = amdahl.infer_compute_share(t_before=11.0, t_after=9.5, compute_speedup=4.5)
    assert hours == pytest.approx({"compute": 27 / 14, "not_compute": 11 - 27 / 14,
                                   "compute_share": 27 / 154, "not_compute_share": 1 - 27 / 154,
                                   "compute_after": 3 / 7, "t_after": 9.5}, rel=1e-12)
    # the second run is its compute at k times the speed plus the unchanged rest
    for k, after in ((2.0, 10.0), (4.5, 9.5), (8.0, 6.0)):
        got = amdahl.infer_compute_share(11.0, after, k)
        assert got["compute_after"] + got["not_compute"] == pytest.approx(after, rel=1e-12)
        assert got["compute_after"] == pytest.approx(got["compute"] / k, rel=1e-12)
    # at either end of a 4-5x ratio, ~80% of the 4070 run was not compute
    for k in (4.0, 5.0):
        assert amdahl.infer_compute_share(11, 9.5, k)["not_compute_share"] > 0.79


def test_findings_rank_by_seconds_saved_and_rest_on_numbers():
    found = amdahl.findings(constructed())
    assert found["stage"].tolist()[:2] == ["fetch_data", "load_model"]
    assert found["rank"].tolist() == list(range(1, len(found) + 1))
    assert (found["seconds_saved"].diff().dropna() <= 0).all()
    assert "compute" not in set(found["stage"])
    assert found.iloc[0]["evidence"].startswith("fetch_data: 30 s")


def test_data_wait_flag_and_note_thresholds():
    flagged = amdahl.findings(constructed(wait=(0.5, 0.5, 0.5), compute=(1, 1, 1)))
    assert flagged.set_index("stage").loc["data_wait", "severity"] == "flag"  # 33% of step
    noted = amdahl.findings(constructed(wait=(0.05, 0.05, 0.05), compute=(1, 1, 1)))
    assert noted.set_index("stage").loc["data_wait", "severity"] == "note"  # ~4.8%
    quiet = amdahl.findings(constructed(wait=(0.01, 0.01, 0.01), compute=(1, 1, 1)))
    assert "data_wait" not in set(quiet["stage"])  # ~1%: below the note threshold


def test_extra_findings_are_ranked_with_the_rest():
    extra = pd.DataFrame([{"stage": "load_model", "finding": "persistent HF_HOME",
                           "seconds_saved": 100.0, "evidence": "fresh 101 s vs cached 1 s"}])
    found = amdahl.findings(constructed(load=120.0), advice=extra)
    assert found.iloc[0]["finding"] == "persistent HF_HOME"
    assert found.iloc[0]["rank"] == 1
    # the measured, specific fix replaces the generic one for its stage
    assert found[found["stage"] == "load_model"]["finding"].tolist() == ["persistent HF_HOME"]
    assert "fetch_data" in set(found["stage"])
    assert "data_wait" in set(found["stage"])  # the stages after the replaced one still count


@pytest.mark.parametrize("frame, message", [
    (pd.DataFrame(), "frame is empty"),
    (pd.DataFrame({"stage": ["fetch"], "seconds": [1.0]}), r"unknown stage\(s\) \['fetch'\]"),
    (pd.DataFrame({"stage": ["eval"], "seconds": [-1.0]}),
     "negative duration -1.0 s for stage 'eval'"),
    (pd.DataFrame({"stage": ["eval"]}), "lacks column"),
])
def test_bad_frames_are_named(frame, message):
    with pytest.raises(ValueError, match=message):
        amdahl.shares(frame)


def test_bad_speedups_and_devices_are_named():
    with pytest.raises(ValueError, match=r"speedup\['compute'\]=0: must be a number > 0"):
        amdahl.project(constructed(), {"compute": 0})
    with pytest.raises(ValueError, match=r"speedup\['compute'\]=-2"):
        amdahl.project(constructed(), {"compute": -2})
    with pytest.raises(ValueError, match="speedup for unknown stage 'gpu'"):
        amdahl.project(constructed(), {"gpu": 2.0})
    with pytest.raises(ValueError, match="unknown GPU 'TPU v5'.*allowed devices are.*H100 SXM"):
        amdahl.upgrade(constructed(), "TPU v5", "H100 SXM")
    with pytest.raises(ValueError, match="compute_speedup=1: must be > 1"):
        amdahl.infer_compute_share(11, 9.5, 1)
    with pytest.raises(ValueError, match="faster than the compute ratio allows"):
        amdahl.infer_compute_share(11, 2, 4.5)


def test_findings_group_by_run_and_skip_noise():
    frame = pd.concat([constructed("naive"), constructed("optimized", fetch=0.5, load=2.0)])
    frame = pd.concat([frame, pd.DataFrame([{"stage": "h2d", "seconds": 1e-6, "step": 0,
                                             "run": "naive"}])])
    found = amdahl.findings(frame)
    assert list(dict.fromkeys(found["run"])) == ["naive", "optimized"]
    naive = found[found["run"] == "naive"]
    assert naive["rank"].tolist() == list(range(1, len(naive) + 1))
    assert "h2d" not in set(found["stage"])  # 3e-6 s of a 44 s run: noise, not a finding


def test_train_without_step_stages_is_the_work_not_a_fix():
    frame = pd.DataFrame({"stage": ["fetch_data", "train"], "seconds": [5.0, 50.0]})
    table = amdahl.shares(frame).set_index("stage")
    assert table.loc["train", "share"] == pytest.approx(50 / 55)
    found = amdahl.findings(frame)
    assert found["stage"].tolist() == ["fetch_data"]


def test_a_stall_every_fourth_step_is_counted():
    # a median per step would call data_wait 0.01 s/step and drop 4 s of stalls
    waits = [2.0 if i % 4 == 3 else 0.01 for i in range(8)]
    frame = constructed(wait=waits, compute=[1.0] * 8, fetch=0.0, load=0.0)
    table = amdahl.shares(frame).set_index("stage")
    assert table.loc["data_wait", "seconds"] == pytest.approx(sum(waits))
    assert table["seconds"].sum() == pytest.approx(sum(waits) + 8.0)  # = the measured train
    assert amdahl.findings(frame).iloc[0]["stage"] == "data_wait"


def test_step_stages_timed_without_watch_are_summed_not_lost():
    frame = pd.DataFrame({"stage": ["fetch_data", "compute", "compute", "compute"],
                          "seconds": [1.0, 5.0, 5.0, 5.0]})
    table = amdahl.shares(frame).set_index("stage")
    assert table.loc["compute", "seconds"] == pytest.approx(15.0)
    assert "without step numbers" in table.loc["compute", "basis"]
    assert table.loc["fetch_data", "share"] == pytest.approx(1 / 16)


def test_a_finding_saves_only_what_its_fix_removes():
    # the Trainer's set-up (no setting changes it) is the largest stage; warm-up is one step of
    # 2.5 s where a steady step (data_wait + compute) is 1.3 s: 1.2 s of it is start-up
    frame = pd.concat([constructed(fetch=2.0, load=1.0), pd.DataFrame([
        {"stage": "setup", "seconds": 20.0, "step": pd.NA, "run": "naive"},
        {"stage": "warmup", "seconds": 2.5, "step": pd.NA, "run": "naive"}])])
    found = amdahl.findings(frame).set_index("stage")
    assert "setup" not in found.index and "compute" not in found.index
    steady = (0.7 + 3.2) / 3
    assert found.at["warmup", "seconds_saved"] == pytest.approx(2.5 - steady)
    assert "less 1 steady step" in found.at["warmup", "evidence"]
    assert found.index[0] == "fetch_data"  # the top fix is one a setting makes
    # scaled to a longer run the steady step is the same mean: the same start-up
    longer = amdahl.findings(frame, total_steps=300, min_share=0).set_index("stage")
    assert longer.at["warmup", "seconds_saved"] == pytest.approx(2.5 - steady)
    # a warm-up no slower than a steady step has nothing to remove
    frame.loc[frame["stage"] == "warmup", "seconds"] = steady
    assert "warmup" not in set(amdahl.findings(frame)["stage"])
