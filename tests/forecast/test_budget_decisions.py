"""`diag run --budget`: what the job's decisions (accum, checkpointing, loader) may spend on
repeats is their share above their floors, so the whole diagnosis fits its budget; arithmetic
on the plan made before the first step (nothing runs)."""

from __future__ import annotations

import pytest

from diag.config import DiagnoseConfig
from diag.diagnose import job_config, steps
from diag.forecast.budget import of_run

DECIDING = ("grad-accum sweep", "checkpointing", "data loader")  # the steps that repeat


def _planned(text: str):
    cfg = DiagnoseConfig.quick(budget=text)
    budget = of_run(cfg, steps(cfg), job_config(cfg))
    return budget, budget.plan().set_index("step"), job_config(cfg, budget).decide_budget_s


@pytest.mark.parametrize("text", ["1m", "5m", "2h"])
def test_the_decisions_get_their_shares_above_their_floors(text):
    budget, plan, repeats = _planned(text)
    above = plan.loc[list(DECIDING), "estimated_s"] - plan.loc[list(DECIDING), "floor_s"]
    assert (above > 0).all() and plan.loc[list(DECIDING), "sized_to_share"].all()
    # the shares now: what is left once planning took its (milliseconds of) time, split again
    assert repeats == pytest.approx(above.sum(), abs=0.5)
    # every step's floor plus the repeats on top of the deciding steps' floors: the budget
    assert plan["floor_s"].sum() + repeats <= budget.total_s
    assert plan["estimated_s"].sum() == pytest.approx(budget.total_s)


def test_a_budget_of_just_the_floors_leaves_the_decisions_no_repeats():
    least = f"{_planned('1m')[1]['floor_s'].sum():g}s"
    _, plan, repeats = _planned(least)
    assert plan["estimated_s"].sum() == pytest.approx(plan["floor_s"].sum())
    assert repeats == pytest.approx(0.0, abs=1e-6)
