"""The cost table and what is read from it: prices, the predicted vs measured check, the
waterfall, the headline (diag.forecast.costs, diag.forecast.story), on constructed rows."""

import pytest

from diag.forecast import costs as table
from diag.forecast import story


def _rows(naive_step=0.5, opt_step=0.2, rounds=5, before=True, spread=0.0):
    """A comparison's measurement rows on the CPU clock: per plan a start (fetch, model folder
    inside load_model, setup) and 2 warm-up + 8 steady steps of 100 slots; before the runs
    each plan's starts and own step."""
    rows = []
    for r in range(rounds):
        wobble = 1 + spread * (r % 2)
        for plan, step, fetch, folder in (("naive", naive_step, 1.0, 2.0),
                                          ("optimized", opt_step, 0.1, 0.05)):
            rows += [table.row(plan, "fetch_data", "source", fetch, clock="CPU", rnd=r),
                     table.row(plan, "load_model", "start", folder + 1.0, clock="CPU", rnd=r),
                     table.row(plan, "download", "start", folder, clock="CPU", rnd=r),
                     table.row(plan, "setup", "start", 0.3 + 0.01 * r, clock="CPU", rnd=r),
                     table.row(plan, "warmup", "warmup_slot", 2 * step * wobble, 200,
                               clock="CPU", rnd=r),
                     table.row(plan, "train", "slot", 8 * step * wobble, 800, clock="CPU",
                               rnd=r)]
            if before:
                rows += [table.row(plan, "fetch_data", "start", fetch * 0.9, clock="CPU",
                                   when="before", rnd=r),
                         table.row(plan, "download", "start", folder, clock="CPU",
                                   when="before", rnd=r),
                         table.row(plan, "train", "step", step, clock="CPU", when="before",
                                   rnd=r),
                         table.row(plan, "warmup", "warmup_step", step, clock="CPU",
                                   when="before", rnd=r)]
    return table.measured(rows)


COUNTS = {p: {"start": 1, "source": 1, "warmup_slot": 200, "slot": 800, "warmup_step": 2,
              "step": 8} for p in ("naive", "optimized")}
FIXES = {"fetch_data": ["fetch pull -> land"], "load_model": ["model_cache empty -> persistent"],
         "warmup": ["micro_batch 1 -> 4"], "train": ["micro_batch 1 -> 4"]}


def test_a_cost_is_the_median_per_unit_over_rounds_with_its_interval():
    rows = table.measured([table.row("naive", "train", "slot", s, 100, rnd=i)
                           for i, s in enumerate([1.0, 3.0, 2.0, 2.2, 1.8])])
    (cost,) = table.table(rows).itertuples()
    assert cost.seconds == pytest.approx(0.02) and cost.samples == 5
    assert (cost.low, cost.high) == (pytest.approx(0.01), pytest.approx(0.03))  # 5: min-max
    assert cost.unit == "slot" and cost.clock == "wall" and cost.when == "runs"


def test_a_price_is_cost_times_count_per_plan_on_one_clock():
    costs = table.table(_rows())
    priced = table.price(costs, COUNTS, clock="CPU", when="runs").set_index(["plan", "stage"])
    assert priced.at[("naive", "train"), "seconds"] == pytest.approx(8 * 0.5)
    assert priced.at[("optimized", "warmup"), "seconds"] == pytest.approx(2 * 0.2)
    assert "slot x 800" in priced.at[("naive", "train"), "evidence"]
    assert table.price(costs, COUNTS, clock="wall").empty  # nothing measured on that clock
    flat = table.price(costs[costs["plan"] == "naive"], {"slot": 1600}, clock="CPU",
                       when="runs")  # counts per unit alone: every plan at them
    assert flat.set_index("stage").at["train", "seconds"] == pytest.approx(8.0)


def test_the_check_predicts_each_fixed_stage_from_before_and_nothing_for_the_others():
    costs = table.table(_rows())
    before, runs = (table.price(costs, COUNTS, clock="CPU", when=w) for w in ("before", "runs"))
    got = story.check(before, runs, "CPU", FIXES).set_index("stage")
    assert got.at["train", "predicted_s"] == pytest.approx(8 * (0.5 - 0.2))
    assert got.at["train", "measured_s"] == pytest.approx(8 * 0.3)
    assert not got.at["train", "flagged"]
    # the model cache is checked on its model folder, the part the fix sets
    assert got.at["load_model", "predicted_s"] == pytest.approx(1.95)
    assert got.at["load_model", "measured_s"] == pytest.approx(1.95)
    assert "its model folder" in got.at["load_model", "evidence"]
    assert got.at["setup", "predicted_s"] == 0 and got.at["setup", "finding"] == "unchanged"
    # fetch: predicted 0.81 s, measured 0.9 s: 11% off, within the 25% tolerance
    assert got.at["fetch_data", "error_share"] == pytest.approx(0.09 / 0.81)
    assert (got["clock"] == "CPU").all()


def test_a_prediction_is_flagged_past_the_tolerance_both_ways_and_never_under_the_floor():
    assert story.judged("s", "f", 1.0, 1.3)["flagged"]
    assert story.judged("s", "f", 1.0, 0.7)["flagged"]
    assert not story.judged("s", "f", 1.0, 1.2)["flagged"]
    assert not story.judged("s", "f", 0.0, 0.04)["flagged"]  # under the floor
    assert story.judged("s", "f", None, 1.0)["error_share"] is None
    assert "25% of itself, or of 0.2 s" in story.TOLERANCE


def test_the_waterfall_walks_from_naive_to_the_measured_optimized_total():
    costs = table.table(_rows())
    runs = table.price(costs, COUNTS, clock="CPU", when="runs")
    flow = story.waterfall(runs, "CPU", FIXES)
    assert list(flow["bar"]) == ["naive", "fetch_data", "load_model", "warmup", "train",
                                 "unchanged", "optimized"]
    naive = table.total(runs[runs["stage"] != "download"], "naive")
    optimized = table.total(runs[runs["stage"] != "download"], "optimized")
    assert flow["seconds"].iloc[0] == pytest.approx(naive)
    assert flow["seconds"].iloc[-1] == pytest.approx(optimized)
    # the fixes' savings and the named residual add up to the gap exactly
    assert flow["change"].sum() == pytest.approx(optimized - naive)
    assert flow.set_index("bar").at["unchanged", "stage"] == "setup"
    assert flow.set_index("bar").at["train", "fixes"] == "micro_batch 1 -> 4"


def test_the_headline_says_its_rounds_and_whether_the_gap_resolved():
    tokens = {"naive": 1000, "optimized": 1000}
    totals = {"naive": 10.0, "optimized": 4.0}
    clear = story.headline({"naive": [10, 10.2, 9.9, 10.1, 10.0], "optimized": [4, 4.1, 3.9,
                                                                              4.0, 4.2]},
                           tokens, "CPU", totals)
    assert clear["resolved"] and clear["speedup"] == pytest.approx(2.5)
    assert "resolved over 5 interleaved rounds" in clear["text"]
    assert "CPU s" in clear["text"] and clear["low"] <= 2.5 <= clear["high"]
    one = story.headline({"naive": [10.0], "optimized": [4.0]}, tokens, "CPU", totals)
    assert not one["resolved"] and "not resolved in 1 round (a gap needs 5" in one["text"]
    mixed = story.headline({"naive": [10, 4, 10, 4, 10], "optimized": [4, 10, 4, 10, 4]},
                           tokens, "wall", totals)
    assert not mixed["resolved"] and "within noise" in mixed["text"]
    assert " s -> optimized 4 s per start" in mixed["text"]


def test_step_predictions_are_restated_when_the_runs_met_another_machine_speed():
    costs = table.table(_rows())
    before, runs = (table.price(costs, COUNTS, clock="CPU", when=w) for w in ("before", "runs"))
    checked = story.check(before, runs, "CPU", FIXES)
    slower = story.restated(checked, [0.75, 0.76, 0.74, 0.75, 0.75],
                            [0.5, 0.51, 0.49, 0.5, 0.5], "CPU").set_index("stage")
    assert slower.at["train", "predicted_s"] == pytest.approx(8 * 0.3 * 1.5)
    assert "x 1.5" in slower.at["train", "evidence"] and "before: 2.4" in slower.at[
        "train", "evidence"]
    assert slower.at["fetch_data", "predicted_s"] == checked.set_index("stage").at[
        "fetch_data", "predicted_s"]  # a start is not a step
    same = story.restated(checked, [0.5, 0.6, 0.4, 0.55, 0.45], [0.5, 0.52, 0.48, 0.5, 0.51],
                          "CPU").set_index("stage")
    assert same.at["train", "predicted_s"] == pytest.approx(8 * 0.3)
    assert "within noise" in same.at["train", "evidence"]
