"""diag.noise's contracts at their edges (constructed samples, a clock the test moves): an
empty side, the median's interval against its binomial definition, when a median is settled,
which side a choice names, and what a round's time budget counts."""

from __future__ import annotations

import time
from fractions import Fraction
from math import comb

import pytest

from diag import noise


def test_an_empty_side_is_no_evidence():
    for a, b in (([], [1.0, 2.0]), ([1.0, 2.0], []), ([], [])):
        assert noise.u_test(a, b) == 1.0


def test_the_spread_is_the_interquartile_range_over_the_median():
    assert noise.spread([]) == noise.spread([5.0]) == 0.0  # no spread of one sample
    assert noise.spread([1.0, 3.0]) == 0.5  # quartiles 1.5 and 2.5 (inclusive), median 2
    assert noise.spread([10.0, 2.0, 6.0, 8.0, 4.0]) == pytest.approx(4 / 6)  # 4 and 8 over 6


def _order_statistic(n: int, level: float) -> int:
    """k of the interval (x_k, x_{n-k+1}), 1-based: the largest k with P(Binomial(n, 1/2) < k)
    <= (1 - level) / 2 (at least 1), in exact fractions."""
    limit, k = Fraction(1 - level) / 2, 1
    below = Fraction(1 + n, 2 ** n)  # P(X < k + 1)
    while below <= limit:
        k += 1
        below += Fraction(comb(n, k), 2 ** n)
    return k


@pytest.mark.parametrize("level", [0.95, 0.9, 0.875, 0.8, 0.75])  # 0.875: a tail exactly at it
def test_the_median_interval_is_the_binomial_order_statistics(level):
    for n in range(1, 80):
        values = [float(i) for i in range(n, 0, -1)]  # order statistic j is j
        k = _order_statistic(n, level)
        mid, lo, hi = noise.median_interval(values, level)
        assert (lo, hi) == (k, n - k + 1), (n, level)
        assert mid == (n + 1) / 2


def test_a_median_is_settled_at_exactly_its_share_and_scales_with_it():
    # 5 values: the interval is the smallest and largest; half-width 0.25 of a median of 1
    at = [0.75, 1.0, 1.0, 1.0, 1.25]
    assert noise.unsettled({"a": at}, within=0.25) == []
    assert noise.unsettled({"a": at}, within=0.24) == ["a"]
    # the same spread around a median of 2 is half the share
    assert noise.unsettled({"b": [v + 1 for v in at]}, within=0.125) == []
    assert noise.unsettled({"c": [2 * v for v in at]}, within=0.25) == []


def test_a_resolved_gap_reads_as_how_many_times_faster_either_way_round():
    fast, slow = [1.0, 1.01, 0.99, 1.02, 0.98], [2.0, 2.02, 1.98, 2.04, 1.96]
    for a, b in ((fast, slow), (slow, fast)):
        assert noise.compare(a, b).describe().startswith("resolved (2.00x, 5 + 5 samples")
    assert noise.unresolved({"fast": fast, "slow": slow}) == []


def test_a_choice_names_its_default_and_the_side_it_was_compared_with():
    fast, slow = [1.0, 1.01, 0.99, 1.02, 0.98], [2.0, 2.02, 1.98, 2.04, 1.96]
    took = noise.choose({"naive": slow, "fix": fast}, "naive")
    assert (took.value, took.default, took.best, took.rival) == ("fix", "naive", "fix", "naive")
    kept = noise.choose({"naive": fast, "fix": slow}, "naive")
    assert (kept.value, kept.default, kept.best, kept.rival) == ("naive", "naive", "naive", "fix")
    alone = noise.choose({"naive": fast}, "naive")
    assert (alone.value, alone.against, alone.rival, alone.resolved) == ("naive", None, None,
                                                                         False)


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    return now


def _rounds(clock, **kw):
    def one_second_round():
        clock[0] += 1.0
        return [1.0, 2.0]

    return noise.Rounds(one_second_round, lambda samples: True, **kw)


def test_the_budget_counts_every_round_but_the_owed_ones(clock):
    plain = _rounds(clock, budget_s=2.5, min_rounds=1)
    assert len(plain.run()[0]) == 3 and plain.out_of_time and plain.spent_s == 3.0
    owed = _rounds(clock, budget_s=2.5, min_rounds=1, owed=2)
    assert len(owed.run()[0]) == 5 and owed.spent_s == 3.0  # 2 owed, then 3 of the budget
    none = _rounds(clock, budget_s=2.5, max_rounds=0)
    assert none.run() == [] and none.spent_s == 0.0


def test_a_round_must_give_one_sample_per_side():
    sizes = iter([[1.0, 2.0], [1.0, 2.0, 3.0]])
    rounds = noise.Rounds(lambda: next(sizes), lambda samples: True, budget_s=60, min_rounds=1)
    with pytest.raises(ValueError):
        rounds.run()
