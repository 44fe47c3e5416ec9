"""The ETA of `diag train` counts the evals and saves the run will make, fresh or resumed: a
resume runs no step-0 eval and none of the evals or saves before its checkpoint; every count
checked against the steps walked one by one (constructed counts, nothing trains)."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest

from diag.forecast import costs as table, eta


def _walked(steps: int, every_eval: int, every_save: int, done: int) -> tuple[int, int]:
    """(evals, saves) of the steps after `done`, walked: the held-out loss before a fresh run's
    first step, every every_eval steps and after the last; a checkpoint every every_save steps
    and after the last, then the output adapter."""
    evals = int(done == 0)
    evals += sum(s % every_eval == 0 or s == steps for s in range(done + 1, steps + 1))
    saves = sum(s % every_save == 0 or s == steps for s in range(done + 1, steps + 1)) + 1
    return evals, saves


def test_evals_and_saves_are_those_the_run_makes_fresh_or_resumed():
    for steps, every_eval, every_save in itertools.product(range(1, 14), range(1, 6), (1, 3, 6)):
        for done in range(steps):
            counts = eta.job_counts(steps, warmup=2, tokens_per_step=100, slots_per_step=128,
                                    every_eval=every_eval, every_save=every_save, eval_slots=50,
                                    done=done)
            evals, saves = _walked(steps, every_eval, every_save, done)
            assert (counts["eval_slot"], counts["save"]) == (evals * 50, saves), (
                steps, every_eval, every_save, done)
            left, warm = steps - done, min(2, steps - done)  # a resumed process warms up again
            assert (counts["token"], counts["warmup_slot"], counts["slot"]) == (
                left * 100, warm * 128, (left - warm) * 128)


def _costs(plan: str, stage: str, *units: tuple[str, float]) -> pd.DataFrame:
    return table.table(table.measured(table.row(plan, stage, u, s) for u, s in units))


def test_a_resumes_eta_prices_no_step_0_eval():
    costs = _costs("optimized", "eval", ("eval_slot", 0.01))

    def eval_s(done: int) -> float:
        counts = eta.job_counts(10, warmup=1, tokens_per_step=100, slots_per_step=100,
                                every_eval=3, every_save=5, eval_slots=100, done=done)
        return table.total(table.price(costs, counts), costs["plan"].iloc[0])

    assert eval_s(0) == pytest.approx(5 * 1.0)  # steps 0, 3, 6, 9 and 10
    assert eval_s(4) == pytest.approx(3 * 1.0)  # 6, 9 and 10: not 0, not 3
    assert eval_s(9) == pytest.approx(1 * 1.0)  # the last one only


def test_the_eta_prices_a_cache_build_and_the_naive_reads_only_where_the_run_makes_them():
    costs = _costs("naive", "preprocess", ("byte", 1e-6), ("record", 0.01))

    def preprocess_s(**more) -> float:
        counts = eta.job_counts(10, 1, 100, 100, 5, 5, 100, **more)
        return table.total(table.price(costs, counts), costs["plan"].iloc[0])

    assert preprocess_s() == 0.0  # a cache hit, no records read: nothing to price
    assert preprocess_s(built_bytes=2_000_000, records=300) == pytest.approx(2.0 + 3.0)
