"""diag.loader.advice on constructed sweep frames (no sleeps, no DataLoader): the 2% goal, the
near-best rule and its residual, ceil(B*d/s) workers, the findings' prices, and the decisions."""

from __future__ import annotations

import importlib
import math

import pandas as pd
import pytest

from diag.decision import MeasuredOn
from diag.loader.advice import advice as findings
from diag.loader.advice import choose_workers, decide, recommend

advice = importlib.import_module("diag.loader.advice")  # diag.loader.advice is also a function


def sweep(waits_ms: dict, step_ms: float = 20.0, pipeline: str = "packed",
          tokens_per_s: float = 400.0, samples_per_s: float | None = None, repeats: int = 5,
          **columns) -> pd.DataFrame:
    """`repeats` rows per num_workers (five: the fewest a noise rule resolves two settings'
    gap with); a wait may be (wait_ms, step_ms)."""
    rows = []
    for w, wait in waits_ms.items():
        wait_ms, step = wait if isinstance(wait, tuple) else (wait, step_ms)
        wait_s, step_s = wait_ms / 1e3, step / 1e3
        for r in range(repeats):
            rows.append({"pipeline": pipeline, "num_workers": w, "repeat": r, "pin_memory": True,
                         "persistent_workers": w > 0, "prefetch_factor": 2 if w else None,
                         "samples_per_s": samples_per_s or 8 / (wait_s + step_s),
                         "tokens_per_s": tokens_per_s, "data_wait_s": wait_s, "step_s": step_s,
                         "data_wait_share": wait_s / (wait_s + step_s), "batch_size": 8,
                         "cores": 2, "consumer": "the QLoRA step", "seq_len": 64,
                         "error": ""} | columns)
    return pd.DataFrame(rows)


def _one(frame: pd.DataFrame, **kw) -> dict:
    (row,) = recommend(frame, **kw).to_dict("records")
    return row


# -- recommend ---------------------------------------------------------------------------------

def test_the_fewest_workers_under_the_goal_are_recommended():
    row = _one(sweep({0: 40.0, 1: 20.0, 2: 0.3, 4: 0.2}))
    assert (row["recommended_workers"], row["baseline_workers"]) == (2, 0)
    assert row["data_wait_share"] == pytest.approx(0.3 / 20.3)
    assert row["baseline_share"] == pytest.approx(40 / 60)
    assert row["verdict"] == "num_workers=2 keeps data_wait at 1.5% of the step (target < 2%)"
    assert row["samples_per_s"] == pytest.approx(8 / 0.0203)
    assert (row["per_sample_ms"], row["per_batch_ms"], row["step_ms"]) == pytest.approx(
        (5.0, 40.0, 20.0))
    assert row["workers_needed"] == 2 == math.ceil(8 * 5.0 / 20.0)  # ceil(B*d/s)
    assert (row["cores"], row["failed_workers"], row["pipeline"]) == (2, "", "packed")
    assert row["tokens_per_s"] == 400.0


def test_a_share_exactly_at_the_goal_is_not_under_it():
    # data_wait 1 s against a 3 s step: exactly 25%, neither kept up nor hidden by 0 workers
    row = _one(sweep({0: (1000.0, 3000.0)}), target_share=0.25)
    assert pd.isna(row["recommended_workers"]) and row["workers_needed"] == 1
    assert "no setting keeps data_wait under 25% (best: num_workers=0 at 25.0%)" in row["verdict"]
    assert _one(sweep({0: (1000.0, 3000.0)}), target_share=0.26)["recommended_workers"] == 0


def test_a_cheap_loop_needs_no_workers():
    row = _one(sweep({0: 0.1, 2: 0.05}))
    assert row["recommended_workers"] == 0 and row["workers_needed"] == 0


def test_no_setting_under_the_goal_with_enough_workers_tried_names_the_hand_off():
    row = _one(sweep({0: 40.0, 1: 20.8, 2: 0.8, 4: 0.75}))
    assert pd.isna(row["recommended_workers"]) and row["workers_needed"] == 2
    assert row["data_wait_share"] == pytest.approx(0.75 / 20.75)  # the best one is shown
    assert row["verdict"] == (
        "no setting keeps data_wait under 2% (best: num_workers=4 at 3.6%): preprocessing costs "
        "5 ms per sample (40 ms per batch of 8) against a 20 ms step, which 2 worker(s) would "
        "hide, yet with workers the loop still waits 0.75 ms per batch: that is the hand-off "
        "from worker processes and the loop's own overhead, which only a longer step (a larger "
        "batch) amortizes")


def test_no_setting_under_the_goal_with_too_few_workers_tried_says_how_many_cores():
    row = _one(sweep({0: 80.0, 1: 60.0}))
    assert row["workers_needed"] == 4 and pd.isna(row["recommended_workers"])
    assert row["verdict"] == (
        "no setting keeps data_wait under 2% (best: num_workers=1 at 75.0%): preprocessing "
        "costs 10 ms per sample (80 ms per batch of 8) against a 20 ms step, so it needs 4 "
        "workers on as many free cores (this machine has 2), or the token cache (packed)")


def test_without_a_zero_worker_row_the_cost_is_unknown():
    row = _one(sweep({1: 30.0, 2: 25.0}).drop(columns="cores"))
    assert pd.isna(row["workers_needed"]) and math.isnan(row["per_batch_ms"])
    assert row["cores"] == 0 and row["baseline_workers"] == 1
    assert row["verdict"] == ("no setting keeps data_wait under 2% (best: num_workers=2 at "
                              "55.6%)")


def test_medians_over_repeats_failed_settings_and_pipelines_in_order():
    frame = sweep({0: 40.0, 2: 0.3}, repeats=3, pipeline="naive")
    frame.loc[1, "data_wait_s"] = 9.0  # one slow repeat of num_workers=0: the median holds
    failed = sweep({4: 0.1}, pipeline="naive", error="OSError: boom")
    packed = sweep({1: 0.1, 0: 0.2}, error=None)  # a missing error is no error
    out = recommend(pd.concat([failed, frame, packed], ignore_index=True))
    assert list(out["pipeline"]) == ["naive", "packed"]
    naive, pk = out.to_dict("records")
    assert naive["failed_workers"] == "4" and naive["baseline_workers"] == 0  # 4 failed first
    assert naive["per_batch_ms"] == pytest.approx(40.0)
    assert (pk["baseline_workers"], pk["recommended_workers"], pk["failed_workers"]) == (1, 0, "")
    assert str(out["recommended_workers"].dtype) == "Int64"
    assert str(out["workers_needed"].dtype) == str(out["baseline_workers"].dtype) == "Int64"
    assert list(out.columns) == advice.COLUMNS


def test_every_failed_setting_says_the_error():
    row = _one(sweep({0: 1.0, 2: 1.0}, error="SampleError: sample 3: boom"))
    assert row["verdict"] == "every setting failed: SampleError: sample 3: boom"
    assert row["failed_workers"] == "0,2" and row["cores"] == 2


# -- advice: findings priced for the run -------------------------------------------------------

def test_a_recommended_setting_is_priced_against_the_baseline():
    frame = sweep({0: 40.0, 2: 0.3})
    out = findings(frame, recommend(frame), run_steps=100)
    assert list(out.columns) == ["stage", "finding", "seconds_saved", "evidence"]
    (row,) = out.to_dict("records")
    assert row["stage"] == "data_wait"
    assert row["finding"] == ("DataLoader(num_workers=2, persistent_workers=True, "
                              "pin_memory=True) keeps the packed pipeline ahead of the step")
    assert row["seconds_saved"] == pytest.approx((0.040 - 0.0003) * 100)
    assert row["evidence"] == ("packed pipeline: data_wait 66.7% of the step at num_workers=0, "
                               "1.5% at num_workers=2 (20 ms step; 100 steps)")
    assert findings(frame, recommend(frame))["seconds_saved"].iloc[0] == pytest.approx(39.7)


def test_no_setting_under_the_goal_is_priced_at_the_near_best_with_the_cache_named():
    frame = sweep({0: 40.0, 1: 20.8, 2: 0.8, 4: 0.75})
    rec = recommend(frame)
    (row,) = findings(frame, rec, run_steps=10).to_dict("records")
    assert row["seconds_saved"] == pytest.approx((0.040 - 0.0008) * 10)  # 2, not the best 4
    assert row["finding"] == ("workers alone leave the packed pipeline at 3.8% of the step: "
                              "cache the tokens (diag.data.build_token_cache + PackedDataset)")
    assert row["evidence"].endswith("; " + rec["verdict"].iloc[0])
    assert "at num_workers=2 (20 ms step; 10 steps)" in row["evidence"]


def test_a_baseline_that_keeps_up_or_a_fix_that_saves_nothing_is_no_finding():
    frame = sweep({0: 0.1, 2: 0.05})
    assert findings(frame, recommend(frame)).empty
    at_goal = sweep({0: (1000.0, 3000.0), 1: (1.0, 3000.0)})
    assert len(findings(at_goal, recommend(at_goal, 0.25), target_share=0.25)) == 1
    # the baseline waits a larger share of a short step, the setting more seconds of a long one
    worse = sweep({0: (5.0, 5.0), 2: (6.0, 1000.0)})
    assert recommend(worse)["recommended_workers"].iloc[0] == 2
    assert findings(worse, recommend(worse)).empty
    failed = sweep({0: 1.0}, error="boom")
    assert findings(failed, recommend(failed)).empty


def _both(naive_waits, packed_waits, **kw):
    return pd.concat([sweep(naive_waits, pipeline="naive", tokens_per_s=320.0,
                            samples_per_s=10.0, **kw),
                      sweep(packed_waits, pipeline="packed", tokens_per_s=640.0,
                            samples_per_s=20.0, **kw)], ignore_index=True)


def _packing_rows(frame, **kw):
    out = findings(frame, recommend(frame), **kw)
    return out[out["finding"].str.startswith("tokenize once")].to_dict("records")


def test_packing_is_priced_at_the_first_common_setting_with_its_padding():
    frame = _both({0: 40.0, 2: 5.0}, {0: 2.0, 2: 0.1})
    (row,) = _packing_rows(frame, run_steps=100)
    assert row["seconds_saved"] == pytest.approx((0.040 - 0.002) * 100)
    assert row["finding"] == ("tokenize once into a token cache and serve packed windows "
                              "(diag.data.build_token_cache + PackedDataset)")
    assert row["evidence"] == ("at num_workers=0: data_wait 66.7% (naive) vs 9.1% (packed) of "
                               "the step; packed serves 2.00x the tokens per second; naive "
                               "batches are 50% padding, compute a packed step does not waste")
    plain = _packing_rows(frame.drop(columns="seq_len"))[0]["evidence"]
    assert plain.endswith("2.00x the tokens per second")


def test_packing_needs_a_waiting_naive_loop_a_common_setting_and_a_saving():
    assert _packing_rows(_both({0: 0.1, 2: 0.05}, {0: 0.1})) == []  # naive keeps up
    assert _packing_rows(_both({0: 40.0}, {2: 0.1})) == []  # nothing measured at both
    assert _packing_rows(_both({0: 40.0}, {0: 50.0})) == []  # packed waits longer
    assert len(_packing_rows(_both({2: 40.0, 0: 30.0}, {0: 35.0, 2: 1.0}))) == 1  # at 2 first
    assert _packing_rows(_both({0: (1000.0, 3000.0)}, {0: 1.0}), target_share=0.25)
    assert _packing_rows(_both({0: 40.0}, {0: 1.0}, error="boom")) == []


# -- choose_workers: the rule the plan decides by ----------------------------------------------

def _by(waits_s: dict, step_s: float = 0.02) -> pd.DataFrame:
    return pd.DataFrame({"data_wait_s": waits_s,
                         "data_wait_share": {w: s / (s + step_s) for w, s in waits_s.items()}})


def test_choose_the_fewest_under_the_goal():
    w, why = choose_workers(_by({4: 0.0001, 0: 0.04, 2: 0.0003}))
    assert w == 2 and isinstance(w, int)
    assert why == "the fewest workers under 2% data_wait: 2 at 1.5% of the step"
    assert choose_workers(_by({0: 0.04, 2: 0.0003}), goal=0.01)[0] == 2
    assert choose_workers(_by({0: 0.04, 2: 0.0003}), goal=0.0147)[0] == 2  # 0.3/20.3 = 1.478%


def test_none_under_the_goal_takes_the_fewest_within_ten_percent_of_the_best():
    # d = 5 ms per sample, B = 8, s = 20 ms: ceil(B*d/s) = 2 workers hide the work; the 8 ms
    # left is the hand-off, which 4 workers (7.5 ms) barely improve
    by = _by({0: 0.048, 1: 0.028, 2: 0.008, 4: 0.0075})
    w, why = choose_workers(by)
    assert w == 2 == math.ceil(8 * 5 / 20)
    assert why == ("no setting under 2% data_wait; 2 workers is the fewest within 10% (or 1 ms) "
                   "of the best, 7.5 ms per step at 4 workers (28.6% of the step); the 8 ms left "
                   "is the worker hand-off (collate, pass the batch between processes), which "
                   "more workers do not remove")
    # 10% of a 75 ms best is 7.5 ms (more than 1 ms): 82 ms is near, 82.6 ms is not
    assert choose_workers(_by({0: 0.2, 2: 0.082, 4: 0.075}))[0] == 2
    assert choose_workers(_by({0: 0.2, 2: 0.0826, 4: 0.075}))[0] == 4
    assert choose_workers(_by({0: 0.2, 2: 0.0825, 4: 0.075}))[0] == 2  # 1.1 x 75 ms: in


def test_near_the_best_is_within_one_ms_when_ten_percent_is_less():
    assert choose_workers(_by({0: 0.02, 1: 0.0019, 2: 0.001}))[0] == 1  # 0.9 ms over
    assert choose_workers(_by({0: 0.02, 1: 0.0021, 2: 0.001}))[0] == 2  # 1.1 ms over
    assert choose_workers(_by({0: 0.02, 1: 0.0020, 2: 0.001}))[0] == 1  # exactly 1 ms: in


# -- decide ------------------------------------------------------------------------------------

def _got(frame, **kw):
    return {d.setting: d for d in decide(frame, **kw)}


def test_decide_takes_the_rule_with_the_wait_it_saves_and_the_rows():
    frame = sweep({0: 40.0, 1: 20.0, 2: 0.3, 4: 0.2})
    got = _got(frame)
    w = got["num_workers"]
    assert (w.value, w.basis, w.source, w.stage, w.per) == (2, "measured", "loader", "data_wait",
                                                            "step")
    assert (w.baseline, w.baseline_s, w.chosen_s) == (0, 0.04, 0.0003) and len(w.rows) == 20
    assert (w.samples, w.resolved) == ((5, 5), True)  # 2 workers' waits against 0 workers'
    assert list(w.rows[0]) == list(frame.columns)  # the sweep's own columns, no index
    assert w.why.startswith("packed pipeline: the fewest workers under 2%")
    assert w.measured_on == MeasuredOn(step="the QLoRA step", seq_len=64)
    p = got["pipeline"]
    assert (p.value, p.baseline, p.baseline_s, p.chosen_s) == ("packed", "naive", None, 0.0003)
    assert p.why == "real tokens/s per pipeline (medians): packed 400" and len(p.rows) == 5
    assert set(got) == {"num_workers", "pipeline", "pin_memory", "persistent_workers",
                        "prefetch_factor"}


def test_decide_prefers_packed_unless_naive_serves_more_tokens():
    both = pd.concat([sweep({0: 40.0, 2: 0.3}, pipeline="naive", tokens_per_s=300.0),
                      sweep({0: 0.2, 2: 0.1}, pipeline="packed", tokens_per_s=420.0)])
    got = _got(both)  # concatenated: index labels repeat
    assert (got["pipeline"].value, got["num_workers"].value) == ("packed", 0)
    # compared at each worker count apart (pooled, naive's slow 0-worker epochs would widen it)
    assert got["pipeline"].why == (
        "real tokens/s per pipeline (medians): naive 300, packed 420; seconds per token, packed "
        "against naive at each worker count: 0 workers: resolved (1.40x, 5 + 5 samples, spread "
        "0% / 0%); 2 workers: resolved (1.40x, 5 + 5 samples, spread 0% / 0%)")
    assert (got["pipeline"].baseline_s, got["pipeline"].chosen_s) == (0.04, 0.0002)
    assert got["num_workers"].baseline_s == 0.0002
    assert (got["pipeline"].samples, got["pipeline"].resolved) == ((5, 5), True)
    tie = _got(both.assign(tokens_per_s=400.0))  # within noise: the naive plan's kept
    assert tie["pipeline"].value == "naive" and "within noise (0% apart" in tie["pipeline"].why
    assert tie["pipeline"].resolved is False
    faster = _got(both.assign(tokens_per_s=both["pipeline"].map({"naive": 500.0,
                                                                 "packed": 400.0})))
    assert faster["pipeline"].value == "naive" and faster["num_workers"].value == 2
    assert faster["pipeline"].baseline_s == 0.0003  # naive against itself
    only = _got(sweep({0: 40.0, 2: 0.3}, pipeline="naive"))
    assert only["pipeline"].value == "naive"
    on = MeasuredOn(model="m")
    assert _got(both, measured_on=on)["num_workers"].measured_on is on
    bare = _got(sweep({0: 1.0}).drop(columns=["consumer", "seq_len", "error"]))
    assert bare["num_workers"].measured_on == MeasuredOn()


def test_decide_without_a_zero_worker_row_has_no_baseline_seconds():
    got = _got(sweep({2: 0.3, 4: 0.2}))
    assert got["num_workers"].value == 2 and got["num_workers"].baseline_s is None
    assert got["num_workers"].chosen_s == 0.0003


def test_knobs_the_sweep_never_varied_are_labelled_defaults():
    got = _got(sweep({0: 0.2, 2: 0.1}))
    for knob, value in (("pin_memory", True), ("persistent_workers", False),
                        ("prefetch_factor", None)):
        assert (got[knob].value, got[knob].basis, got[knob].source) == (value, "default",
                                                                        "loader")
    assert got["pin_memory"].why == ("not varied by the sweep (every point ran True): the "
                                     "documented default")
    assert got["persistent_workers"].why.startswith("not varied by the sweep (every point ran ")
    assert _got(sweep({0: 40.0, 2: 0.3}))["prefetch_factor"].value == 2
    assert _got(sweep({0: 40.0, 2: 0.3}))["persistent_workers"].value is True
    none = _got(sweep({0: 0.2}).drop(columns="pin_memory"))["pin_memory"]
    assert none.why == "not varied by the sweep: the documented default"


def test_a_varied_knob_takes_the_lowest_wait_at_the_chosen_workers():
    varied = pd.concat([sweep({2: 1.0}), sweep({2: 0.5}, pin_memory=False, prefetch_factor=4),
                        sweep({0: 40.0})])
    got = _got(varied)
    assert (got["pin_memory"].value, got["pin_memory"].basis) == (False, "measured")
    assert got["prefetch_factor"].value == 4 and isinstance(got["prefetch_factor"].value, int)
    assert got["pin_memory"].why == "varied in the sweep; the lowest data_wait at 2 workers"
    assert len(got["pin_memory"].rows) == 10 and got["pin_memory"].stage == "data_wait"
    at_zero = pd.concat([sweep({0: 0.1}), sweep({0: 0.2}, pin_memory=False)])
    got = _got(at_zero)
    assert got["pin_memory"].value is True and got["prefetch_factor"].basis == "default"
    zero_pf = pd.concat([sweep({0: 0.1}, prefetch_factor=2), sweep({0: 0.2}, prefetch_factor=4)])
    assert _got(zero_pf)["prefetch_factor"].value is None  # no workers: nothing prefetched


def test_an_absent_or_failed_sweep_gives_labelled_defaults(monkeypatch):
    from diag.machine import device

    monkeypatch.setattr(device, "usable_cores", lambda: 16)
    for frame in (None, pd.DataFrame()):
        got = _got(frame)
        assert {d.basis for d in got.values()} == {"default"}
        assert got["num_workers"].why == ("loader frame absent: 2 workers (two cores left to "
                                          "the step)")
        assert got["pipeline"].why == "loader frame absent: the packed token cache"
        assert (got["pipeline"].value, got["num_workers"].value) == ("packed", 2)
        assert (got["persistent_workers"].value, got["prefetch_factor"].value) == (True, 2)
        assert got["pin_memory"].why == "loader frame absent: the documented default"
        assert {d.source for d in got.values()} == {"loader"}
    failed = _got(sweep({0: 1.0}, error="SampleError: boom"))
    assert failed["num_workers"].why.startswith("every loader sweep point failed: SampleError")
    monkeypatch.setattr(device, "usable_cores", lambda: 3)
    assert advice.default_workers() == 1
    monkeypatch.setattr(device, "usable_cores", lambda: 1)
    assert advice.default_workers() == 0
    got = _got(None)
    assert (got["num_workers"].value, got["persistent_workers"].value,
            got["prefetch_factor"].value) == (0, False, None)


# -- what the mutants showed: each pipeline priced, the recommendation followed, packing's parts --

def test_each_waiting_pipeline_is_priced_after_one_that_keeps_up_and_packing_is_added():
    # naive keeps up, packed waits: the pipeline after one that keeps up is still priced
    frame = pd.concat([sweep({0: 0.1}, pipeline="naive"), sweep({0: 40.0, 2: 0.3})],
                      ignore_index=True)
    (row,) = findings(frame, recommend(frame)).to_dict("records")
    assert "the packed pipeline" in row["finding"]
    # both wait, and packing saves at num_workers=0: three findings, packing's last
    both = _both({0: 40.0, 2: 5.0}, {0: 2.0, 2: 0.1})
    out = findings(both, recommend(both), run_steps=100)
    assert len(out) == 3 and out["finding"].iloc[2].startswith("tokenize once")
    assert out["seconds_saved"].tolist() == pytest.approx(
        [(0.040 - 0.005) * 100, (0.002 - 0.0001) * 100, (0.040 - 0.002) * 100])


def test_a_baseline_under_the_goal_is_no_finding_even_where_another_setting_waits_less():
    # the baseline (first in the sweep) waits 0.3 ms of a 30 ms step (1.0%); no workers wait
    # 0.2 ms of a 12 ms step (1.6%): fewer seconds, yet the baseline already keeps up
    frame = sweep({2: (0.3, 30.0), 0: (0.2, 12.0)})
    rec = recommend(frame)
    assert (rec["baseline_workers"].iloc[0], rec["recommended_workers"].iloc[0]) == (2, 0)
    assert findings(frame, rec).empty


def test_the_recommendation_given_is_the_setting_priced():
    # recommended against a 5% target, priced with the default 2%: the finding is the setting
    # the recommendation names (1 worker), not one chosen again against 2% (2 workers)
    frame = sweep({0: 40.0, 1: 0.8, 2: 0.3})
    (row,) = findings(frame, recommend(frame, 0.05), run_steps=100).to_dict("records")
    assert row["finding"].startswith("DataLoader(num_workers=1,")
    assert row["seconds_saved"] == pytest.approx((0.040 - 0.0008) * 100)


def test_none_under_the_target_is_priced_at_the_near_best_rule_of_that_target():
    # 200 ms step, target 1%: none under it. Near the best (2.1 ms, within 1 ms): 4 workers;
    # 1 worker (3.9 ms, 1.9%) would be the pick under the default 2% goal
    frame = sweep({0: 100.0, 1: 3.9, 4: 2.1}, step_ms=200.0)
    rec = recommend(frame, 0.01)
    assert pd.isna(rec["recommended_workers"].iloc[0])
    (row,) = findings(frame, rec, run_steps=10, target_share=0.01).to_dict("records")
    assert row["seconds_saved"] == pytest.approx((0.100 - 0.0021) * 10)
    assert "at num_workers=4 (200 ms step; 10 steps)" in row["evidence"]


def test_a_fix_chosen_at_the_baselines_own_wait_saves_nothing_and_is_no_finding():
    frame = sweep({0: 40.0, 2: 40.0})  # no setting helps: the fewest near the best is 0 itself
    assert findings(frame, recommend(frame)).empty


def test_packings_padding_is_the_naive_rows_and_its_price_under_a_second():
    # packed rows carry 64 tokens per sample (no padding), naive ones 32 of 64: 50% padding
    frame = pd.concat([sweep({0: 40.0}, pipeline="naive", tokens_per_s=320.0, samples_per_s=10.0),
                       sweep({0: 2.0}, tokens_per_s=640.0, samples_per_s=10.0)],
                      ignore_index=True)
    (row,) = _packing_rows(frame, run_steps=10)
    assert row["evidence"].endswith("; naive batches are 50% padding, compute a packed step "
                                    "does not waste")
    assert row["stage"] == "data_wait"
    assert row["seconds_saved"] == pytest.approx((0.040 - 0.002) * 10)  # 0.38 s, kept as is
    # rows whose error is missing (None) are good rows: their padding is still counted
    (unset,) = _packing_rows(_both({0: 40.0}, {0: 2.0}, error=None))
    assert "naive batches are 50% padding" in unset["evidence"]
    assert _packing_rows(_both({0: 40.0}, {0: 40.0})) == []  # the same wait: nothing saved


def test_a_sweep_without_an_error_column_is_advised_like_one_without_errors():
    both = _both({0: 40.0, 2: 5.0}, {0: 2.0, 2: 0.1})
    bare = both.drop(columns="error")
    pd.testing.assert_frame_equal(findings(bare, recommend(bare)), findings(both, recommend(both)))


def test_decide_counts_rows_whose_error_is_missing_as_good():
    got = _got(sweep({0: 40.0, 2: 0.3}, error=None))
    assert (got["num_workers"].value, got["num_workers"].basis) == (2, "measured")


def test_pipelines_are_recommended_in_the_sweeps_order_not_by_name():
    frame = pd.concat([sweep({0: 0.2}), sweep({0: 0.1}, pipeline="naive")], ignore_index=True)
    assert recommend(frame)["pipeline"].tolist() == ["packed", "naive"]


def test_decide_chooses_the_workers_at_its_own_goal():
    frame = sweep({0: 40.0, 1: 0.8, 2: 0.3})  # 1 worker waits 3.8% of the step
    assert _got(frame)["num_workers"].value == 2
    assert _got(frame, goal=0.05)["num_workers"].value == 1


def test_decide_with_one_and_more_workers_but_no_zero_row():
    got = _got(sweep({1: 30.0, 2: 0.3}))
    assert (got["num_workers"].value, got["num_workers"].baseline_s) == (2, None)


def test_one_worker_is_kept_persistent(monkeypatch):
    from diag.machine import device

    monkeypatch.setattr(device, "usable_cores", lambda: 3)  # one core to spare: 1 worker
    got = _got(None)
    assert (got["num_workers"].value, got["persistent_workers"].value,
            got["prefetch_factor"].value) == (1, True, 2)
    measured = _got(sweep({0: 40.0, 1: 0.3}))
    assert (measured["num_workers"].value, measured["persistent_workers"].value) == (1, True)


def test_the_verdicts_figures_are_the_measured_milliseconds_to_three_digits():
    # 9.876 ms per batch of 8 = 1.2345 ms per sample, a 12.35 ms step: shown as 1.23 and 12.3
    # (a figure off by a thousandth of itself would show 1.24 and 12.4)
    row = _one(sweep({0: 9.876, 2: 0.8}, step_ms=12.35))
    assert "preprocessing costs 1.23 ms per sample (9.88 ms per batch of 8) against a 12.3 ms " \
           "step, which 1 worker(s) would hide" in row["verdict"]


def test_the_hand_off_is_named_when_exactly_the_workers_needed_ran():
    assert "which 2 worker(s) would hide, yet with workers the loop still waits 0.8 ms" in _one(
        sweep({0: 40.0, 2: 0.8}))["verdict"]
    assert "which 1 worker(s) would hide, yet with workers the loop still waits 0.8 ms" in _one(
        sweep({0: 15.0, 1: 0.8}))["verdict"]
    # no worker needed at the settings' median step (40 ms), yet 0 workers wait 2.9% of their
    # own 10 ms step: "1 worker(s)", never 0
    row = _one(sweep({0: (0.3, 10.0), 1: (1.0, 40.0), 2: (1.0, 40.0)}))
    assert row["workers_needed"] == 0
    assert "which 1 worker(s) would hide, yet with workers the loop still waits 1 ms" in \
        row["verdict"]


def test_the_baseline_is_the_sweeps_first_setting_even_when_its_first_repeat_failed():
    frame = sweep({0: 40.0, 2: 0.3})
    frame = pd.concat([frame.iloc[[0]].assign(error="boom"), frame.iloc[[1]], frame.iloc[[0]]],
                      ignore_index=True)
    row = _one(frame)
    assert (row["baseline_workers"], row["baseline_share"]) == (0, pytest.approx(40 / 60))


def test_a_pipeline_after_one_where_every_setting_failed_is_still_recommended():
    frame = pd.concat([sweep({0: 1.0}, pipeline="naive", error="boom"), sweep({0: 40.0, 2: 0.3})],
                      ignore_index=True)
    out = recommend(frame)
    assert out["pipeline"].tolist() == ["naive", "packed"]
    assert out["verdict"].iloc[0] == "every setting failed: boom"
    assert out["recommended_workers"].iloc[1] == 2


def test_choose_workers_counts_a_share_exactly_at_the_goal_as_not_under_it():
    # 1 s of a 3 s step is exactly 25%: 0 workers are not under 25%, 2 workers (14%) are
    assert choose_workers(_by({0: 1.0, 2: 0.5}, step_s=3.0), goal=0.25)[0] == 2


def test_loader_configs_own_target_picks_the_workers_and_is_named():
    # LoaderConfig's default target (the 2% goal): 60% / 11% / 1% of the step at 0 / 1 / 2
    # workers keeps 2, and the decision says the target; at a 20% target 1 would do
    from diag.config import LoaderConfig

    frame = sweep({0: (60.0, 40.0), 1: (11.0, 89.0), 2: (1.0, 99.0)}, repeats=5)
    decided = {d.setting: d for d in decide(frame, LoaderConfig().target_share)}
    assert decided["num_workers"].value == 2 and "under 2%" in decided["num_workers"].why
    assert {d.setting: d for d in decide(frame, 0.20)}["num_workers"].value == 1


def test_the_pipelines_are_compared_at_each_worker_count_not_pooled():
    # packed serves 1.5x naive's tokens at 0 workers and at 2; pooled over both counts the
    # sides overlap (naive at 2 workers beats packed at 0) and no gap could resolve
    def both(packed_at_two: float) -> pd.DataFrame:
        return pd.concat([sweep({0: 1.0}, pipeline="naive", tokens_per_s=200.0),
                          sweep({2: 0.5}, pipeline="naive", tokens_per_s=400.0),
                          sweep({0: 0.8}, pipeline="packed", tokens_per_s=300.0),
                          sweep({2: 0.4}, pipeline="packed", tokens_per_s=packed_at_two)])

    got = _got(both(600.0))["pipeline"]
    assert (got.value, got.resolved) == ("packed", True)
    assert "0 workers: resolved (1.50x" in got.why and "2 workers: resolved (1.50x" in got.why
    # slower than naive at one worker count, faster at the other: naive kept, not resolved
    mixed = _got(both(300.0))["pipeline"]
    assert (mixed.value, mixed.resolved) == ("naive", False)
