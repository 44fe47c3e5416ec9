"""The ETA (diag.forecast.eta): a job's counts, its price at the cost table's wall costs, the
check after the run, and the costs known before any run (the decisions')."""

import math

import pandas as pd
import pytest

from diag.forecast import eta
from diag.forecast.costs import price, row, measured, table, with_eval


def test_counts_price_the_steps_left_the_evals_and_the_saves():
    counts = eta.job_counts(steps=241, warmup=1, tokens_per_step=250, slots_per_step=250,
                            every_eval=24, every_save=24, eval_slots=900)
    assert (counts["slot"], counts["warmup_slot"], counts["save"]) == (60_000, 250, 12)
    assert counts["eval_slot"] == (1 + 10 + 1) * 900  # before, every 24 steps, at the end
    resumed = eta.job_counts(steps=241, warmup=1, tokens_per_step=250, slots_per_step=250,
                             every_eval=24, every_save=24, eval_slots=900, done=120)
    # a resume runs no step-0 eval: every 24 from step 120 (5 more) and at the end
    assert resumed["eval_slot"] == (5 + 1) * 900
    assert resumed["slot"] == (241 - 120 - 1) * 250 and resumed["save"] == 241 // 24 - 5 + 1 + 1


def test_the_eta_is_cost_times_count_in_wall_seconds_and_says_what_it_cannot_price():
    rows = [row("optimized", "train", "slot", 1.5, 750, rnd=r) for r in range(3)]
    rows += [row("optimized", "setup", "start", 0.4), row("optimized", "preprocess", "start", 0.8)]
    costs = with_eval(table(measured(rows)))
    counts = eta.job_counts(steps=241, warmup=1, tokens_per_step=250, slots_per_step=250,
                            every_eval=24, every_save=24, eval_slots=900)
    mine = price(costs, counts).set_index("stage")
    assert mine.at["train", "seconds"] == pytest.approx(60_000 * 1.5 / 750)
    assert mine.at["eval", "seconds"] == pytest.approx(12 * 900 * 1.5 / 750 / 3)
    line = eta.before_line("head", mine.reset_index())
    assert line.startswith("head; projected 2.1 min (wall) for the whole command, from earlier ")
    assert "train 93%, eval 6%" in line
    assert "not priced: fetch_data, load_model, warmup, checkpoint" in line
    # said after the start's stages ran: what was spent so far, deciding included, and then
    # the stages still to run as priced
    later = eta.before_line("head", mine.reset_index(), spent_s=100.0, done=("preprocess",))
    assert later.startswith("head; projected 3.8 min (wall) for the whole command, 1.7 min of it "
                             "spent")


def test_the_check_flags_a_stage_past_the_tolerance_and_totals_the_run():
    projected = pd.DataFrame({"plan": "optimized", "stage": ["load_model", "train"],
                              "seconds": [5.0, 100.0], "evidence": ["a", "b"]})
    stages = pd.DataFrame({"stage": ["load_model", "train", "setup", "compute"],
                           "seconds": [4.5, 140.0, 1.0, 90.0], "step": [None, None, None, 3]})
    got = eta.check_eta(projected, stages).set_index("stage")
    assert not got.at["load_model", "flagged"] and got.at["train", "flagged"]
    assert got.at["train", "error_share"] == pytest.approx(0.4)
    assert got.at["total", "predicted_s"] == 105.0 and got.at["total", "measured_s"] == 145.5
    assert got.at["total", "evidence"] == "not predicted: setup"
    line = eta.after_line(got.reset_index())
    assert line.startswith("measured 2.4 min against 1.8 min predicted (+39%)") and "train" in line
    assert eta.duration(9000) == "2 h 30 min" and eta.duration(4.2) == "4.2 s"


def test_costs_before_any_run_take_the_sweeps_wall_step_per_slot_and_checkpointing():
    from diag.decision import Decision, MeasuredOn
    from diag.qlora.plans import Plan

    on = MeasuredOn(tokens_per_step=1000)
    rows = [{"micro_batch": m, "seconds_per_step": s, "cpu_s": s / 2}
            for m, s in ((1, 2.0), (1, 2.2), (1, 1.8), (4, 1.0), (4, 1.1), (4, 0.9))]
    micro = Decision.from_rows("micro_batch", 4, "x", rows, source="accum", measured_on=on,
                               baseline=1, stage="compute", per="step", baseline_s=1.0,
                               chosen_s=0.5, clock="CPU")
    ckpt = Decision.from_rows("gradient_checkpointing", False, "x", [{"m": 1}],
                              source="checkpointing", baseline=True, stage="compute",
                              per="step", baseline_s=1.3, chosen_s=1.0, naive_ratio=1.5)
    build = {"bytes": 1e6, "seconds": 1.0, "tokens_per_s": 4000.0, "processes": 2}
    got = {}
    for plan in (Plan.optimized([micro, ckpt]), Plan.naive()):
        costs = eta.from_decisions(plan.name, plan.settings(), [micro, ckpt], build)
        got[plan.name] = costs.set_index(["stage", "unit"])["seconds"]
    # the wall step of the plan's micro-batch (not the CPU seconds the decision compared)
    assert got["optimized"]["train", "slot"] == pytest.approx(1.0 / 1000)
    assert got["naive"]["train", "slot"] == pytest.approx(2.0 * 1.5 / 1000)  # micro 1, ckpt on
    assert got["naive"]["train", "token"] == pytest.approx(2 / 4000)  # tokenized in the loop
    assert ("train", "token") not in got["optimized"].index
    assert got["optimized"]["preprocess", "byte"] == pytest.approx(1e-6)
    assert not any(math.isnan(v) for v in got["optimized"])
