"""diag.amdahl's contract at its edges: exact messages, boundaries, column order, run order.

Written against the mutants `make mutate` found alive (docs/mutation.md): each test pins a
behaviour a user sees (a message, a threshold at its exact value, the order of runs or columns).
"""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest

from diag import amdahl
from tests.test_amdahl import constructed

SHARE_COLUMNS = ["run", "stage", "level", "seconds", "share", "basis"]
FINDING_COLUMNS = ["rank", "run", "stage", "finding", "seconds_saved", "share_of_run", "severity",
                   "evidence"]


def frame(**seconds: float) -> pd.DataFrame:
    return pd.DataFrame({"stage": list(seconds), "seconds": list(seconds.values())})


def test_messages_name_the_field_and_what_is_allowed() -> None:
    cases = [
        (lambda: amdahl.shares(pd.DataFrame()),
         "frame is empty: pass a StageTimer frame with stage and seconds rows"),
        (lambda: amdahl.shares(frame(fetch=1.0)),
         "unknown stage(s) ['fetch']: allowed stages are fetch_data, load_model, preprocess, "),
        (lambda: amdahl.shares(frame(eval=-1.0)),
         "negative duration -1.0 s for stage 'eval': durations must be >= 0"),
        (lambda: amdahl.shares(frame(eval=1.0), total_steps=0),
         "total_steps=0: must be a whole number > 0"),
        (lambda: amdahl.project(frame(eval=1.0), {"gpu": 2.0}),
         "speedup for unknown stage 'gpu': allowed stages are fetch_data, load_model, "),
        (lambda: amdahl.project(frame(eval=1.0), {"eval": 0}),
         "speedup['eval']=0: must be a number > 0 (float('inf') removes the stage)"),
        (lambda: amdahl.compute_ratio("TPU v5", "H100 SXM"),
         "unknown GPU 'TPU v5': allowed devices are B200, H200 SXM, H200 NVL, H100 SXM, "),
        (lambda: amdahl.compute_ratio("A100 80GB", "H100 SXM", "fp8"),
         "no dense fp8 figure for 'A100 80GB': allowed devices are B200, "),
        (lambda: amdahl.infer_compute_share(0, 1, 2), "t_before=0: must be a duration > 0"),
        (lambda: amdahl.infer_compute_share(2, -1, 2), "t_after=-1: must be a duration > 0"),
        (lambda: amdahl.infer_compute_share(2, 3, 2),
         "t_after=3 > t_before=2: a faster GPU cannot make the run slower under Amdahl's law; "
         "check the two times"),
        (lambda: amdahl.infer_compute_share(11, 2, 4.5),
         "t_after=2 is below t_before / compute_speedup = 2.444: faster than the compute ratio "
         "allows"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            call()


@pytest.mark.parametrize("bad", ["2", True, math.nan, -1.0])
def test_speedup_that_is_not_a_positive_number_is_a_value_error(bad) -> None:
    with pytest.raises(ValueError, match=r"speedup\['compute'\]"):
        amdahl.project(constructed(), {"compute": bad})


@pytest.mark.parametrize("bad", ["11", 0, 0.0, -3])
def test_times_that_are_not_positive_durations_are_a_value_error(bad) -> None:
    with pytest.raises(ValueError, match="must be a duration > 0"):
        amdahl.infer_compute_share(bad, 1, 2)
    with pytest.raises(ValueError, match="must be a duration > 0"):
        amdahl.infer_compute_share(11, bad, 2)


def test_boundaries_of_the_inputs_are_accepted() -> None:
    # a slower stage (k < 1), one projected step, sub-second times, equal runs, all compute
    out = amdahl.project(constructed(), {"compute": 0.5}).set_index("stage")
    assert out.loc["compute", "seconds_after"] == pytest.approx(6.4)
    assert amdahl.shares(constructed(), total_steps=1).set_index("stage").loc[
        "compute", "seconds"] == pytest.approx(3.2 / 3)
    assert amdahl.infer_compute_share(1.0, 0.5, 4)["compute"] == pytest.approx(2 / 3)
    assert amdahl.infer_compute_share(10, 10, 2)["compute"] == 0.0
    assert amdahl.infer_compute_share(8, 2, 4)["compute_share"] == 1.0


def test_share_table_columns_levels_and_bases() -> None:
    f = pd.concat([constructed(), pd.DataFrame({"stage": ["checkpoint", "checkpoint", "eval"],
                                                "seconds": [1.0, 2.0, 4.0], "run": "naive"})])
    table = amdahl.shares(f)
    assert list(table.columns) == SHARE_COLUMNS
    rows = table.set_index("stage")
    # run stages after train are kept (train itself is shown as its step parts)
    assert rows.loc["checkpoint", "seconds"] == 3.0 and rows.loc["eval", "seconds"] == 4.0
    assert rows.loc["checkpoint", "basis"] == "measured (2 intervals)"
    assert rows.loc["eval", "basis"] == "measured (1 interval)"
    assert set(rows.loc[["fetch_data", "load_model", "checkpoint"], "level"]) == {"run"}
    assert rows.loc["compute", "basis"] == "measured: 3 steps, mean 1.067 s/step"
    assert amdahl.shares(frame(eval=1.0))["run"].tolist() == ["run"]  # no run column: one run


def test_step_stages_with_and_without_step_numbers_add_up() -> None:
    f = pd.concat([constructed(), pd.DataFrame({"stage": ["compute"], "seconds": [5.0],
                                                "run": "naive"})])
    row = amdahl.shares(f).set_index("stage").loc["compute"]
    assert row["seconds"] == pytest.approx(3.2 + 5.0)
    assert row["basis"] == "measured: 3 steps, mean 1.067 s/step; 5 s without step numbers, summed"
    # no step numbers at all: summed as measured, never scaled to total_steps
    alone = amdahl.shares(frame(compute=5.0), total_steps=1000).set_index("stage")
    assert alone.loc["compute", "seconds"] == 5.0


def test_runs_keep_their_order_of_appearance_everywhere() -> None:
    f = pd.concat([constructed("zeta", fetch=1.0), constructed("alpha", fetch=90.0)])
    assert list(dict.fromkeys(amdahl.shares(f)["run"])) == ["zeta", "alpha"]
    out = amdahl.project(f, {"compute": 2.0})
    assert out.index.tolist() == list(range(len(out)))
    assert out.loc[out["stage"] == "total", "run"].tolist() == ["zeta", "alpha"]
    found = amdahl.findings(f)
    assert list(dict.fromkeys(found["run"])) == ["zeta", "alpha"]  # alpha saves more, comes second
    assert list(found.columns) == FINDING_COLUMNS
    assert found.index.tolist() == list(range(len(found)))


def test_a_run_of_zero_seconds_has_zero_shares() -> None:
    table = amdahl.shares(frame(fetch_data=0.0, eval=0.0))
    assert table["share"].tolist() == [0.0, 0.0]
    assert amdahl.findings(frame(fetch_data=0.0, eval=0.0), min_share=0.0).empty


def test_project_total_row() -> None:
    out = amdahl.project(constructed(), {"fetch_data": 3.0}, total_steps=30)
    total = out.set_index("stage").loc["total"]
    assert (total["level"], total["share"], total["basis"]) == ("total", 1.0, "sum")
    assert total["seconds_before"] == pytest.approx(30 + 10 + (0.7 + 3.2) * 10)
    assert total["seconds_after"] == pytest.approx(10 + 10 + 39)
    gone = amdahl.project(frame(eval=0.5), {"eval": math.inf}).set_index("stage")
    assert math.isnan(gone.loc["total", "speedup"])  # nothing left: no finite speedup
    small = amdahl.project(frame(eval=0.5), {"eval": 2.0}).set_index("stage")
    assert small.loc["total", "speedup"] == pytest.approx(2.0)


def test_upgrade_passes_dtype_and_total_steps_and_states_its_assumption() -> None:
    ratio = amdahl.compute_ratio("RTX 4070", "H100 SXM", "tf32")
    assert ratio == pytest.approx(494.7 / 29.1, rel=1e-9)
    out = amdahl.upgrade(constructed(), "RTX 4070", "H100 SXM", "tf32", total_steps=30)
    rows = out.set_index("stage")
    assert rows.loc["compute", "speedup"] == pytest.approx(ratio, rel=1e-9)
    assert rows.loc["compute", "seconds_before"] == pytest.approx(32.0)
    assert rows.loc["compute", "assumption"] == (
        f"compute and warmup scale with the dense tf32 peak ratio H100 SXM/RTX 4070 = {ratio:.2f}x;"
        " the other stages do not change with the GPU")


def test_findings_scale_with_total_steps_and_keep_other() -> None:
    f = constructed()
    f.loc[f["stage"] == "train", "seconds"] += 30.0  # 10 s per step outside the step stages
    found = amdahl.findings(f, total_steps=30).set_index("stage")
    assert found.loc["other", "seconds_saved"] == pytest.approx(300.0)  # after compute in order
    assert found.loc["fetch_data", "severity"] == "fix"
    assert list(amdahl.findings(f).columns) == FINDING_COLUMNS


def test_min_share_is_inclusive_and_skips_only_the_small_stage() -> None:
    f = frame(fetch_data=1.0, preprocess=0.001, checkpoint=98.999)
    stages = amdahl.findings(f, min_share=0.01)["stage"].tolist()
    assert stages == ["checkpoint", "fetch_data"]  # 1% exactly is in; preprocess is noise
    assert "preprocess" in set(amdahl.findings(f, min_share=0.0)["stage"])


def test_data_wait_thresholds_are_exact() -> None:
    two = constructed(wait=(0.02,), compute=(0.98,), fetch=0.0, load=0.0)
    assert "data_wait" not in set(amdahl.findings(two)["stage"])  # 2% exactly: not a note
    ten = constructed(wait=(0.1,), compute=(0.9,), fetch=0.0, load=0.0)
    assert amdahl.findings(ten).set_index("stage").loc["data_wait", "severity"] == "note"
    quiet = constructed(wait=(0.001,), compute=(1.0,), fetch=0.0, load=0.0)
    quiet.loc[quiet["stage"] == "train", "seconds"] += 1.0  # a large other after data_wait
    assert amdahl.findings(quiet)["stage"].tolist() == ["other"]


def test_extra_findings_share_cap_and_evidence() -> None:
    f = constructed(load=10.0)  # run total 43.9 s
    extra = pd.DataFrame([
        {"stage": "load_model", "finding": "cache", "seconds_saved": 25.0, "evidence": "e1"},
        {"stage": "fetch_data", "finding": "land", "seconds_saved": 30.0, "evidence": "e2"},
        {"stage": "eval", "finding": "smaller split", "seconds_saved": 2.0, "evidence": "e3"}])
    found = amdahl.findings(f, advice=extra).set_index("finding")
    capped = found.loc["cache"]
    assert capped["seconds_saved"] == 10.0
    assert capped["evidence"] == "e1 (capped at the run's load_model: 10 s)"
    assert capped["share_of_run"] == pytest.approx(10 / 43.9)
    assert (capped["severity"], capped["run"], capped["stage"]) == ("fix", "naive", "load_model")
    exact = found.loc["land"]  # saves exactly the stage: not capped, evidence untouched
    assert (exact["seconds_saved"], exact["evidence"]) == (30.0, "e2")
    unmeasured = found.loc["smaller split"]  # a stage this run did not time: nothing to cap at
    assert (unmeasured["seconds_saved"], unmeasured["evidence"]) == (2.0, "e3")
    assert unmeasured["share_of_run"] == pytest.approx(2 / 43.9)


def test_extra_findings_for_another_run_or_no_run() -> None:
    f = pd.concat([constructed("naive"), constructed("tuned", fetch=1.0)])
    extra = pd.DataFrame([{"run": "tuned", "stage": "load_model", "finding": "cache",
                           "seconds_saved": 4.0, "evidence": "e"},
                          {"run": "elsewhere", "stage": "eval", "finding": "x",
                           "seconds_saved": 1.0, "evidence": "e"}])
    found = amdahl.findings(f, advice=extra)
    tuned = found[found["run"] == "tuned"].set_index("stage")
    assert tuned.loc["load_model", "finding"] == "cache"  # the run column is kept, not overwritten
    naive = found[found["run"] == "naive"].set_index("stage")
    assert naive.loc["load_model", "finding"] == amdahl.FIXES["load_model"]
    other = found[found["run"] == "elsewhere"].iloc[0]
    assert math.isnan(other["share_of_run"]) and found["run"].iloc[-1] == "elsewhere"
    zero = amdahl.findings(frame(fetch_data=0.0), advice=extra.iloc[:1].assign(run="run"))
    assert math.isnan(zero.iloc[0]["share_of_run"])  # a run of 0 s has no share to give


def test_no_findings_still_has_the_columns() -> None:
    found = amdahl.findings(frame(fetch_data=0.0))
    assert found.empty and list(found.columns) == FINDING_COLUMNS
