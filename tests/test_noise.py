"""diag.noise: when a timed difference counts as real, and the rounds that settle it."""

from __future__ import annotations

import itertools
import math
import random

from diag import noise


def test_the_exact_u_test_matches_counting_every_ordering():
    # brute force: every way to split 3 + 4 ranks, two-sided, against the DP's p-values
    a, b = [1.0, 4.0, 6.0], [2.0, 3.0, 5.0, 7.0]
    u = sum(x > y for x in a for y in b)
    splits = list(itertools.combinations(range(7), 3))
    us = [sum(i > j for i in s for j in set(range(7)) - set(s)) for s in splits]
    tail = min(u, 12 - u)
    want = 2 * sum(x <= tail for x in us) / len(splits)
    assert math.isclose(noise.u_test(a, b), min(1.0, want))
    assert math.isclose(noise.u_test(range(5), range(10, 15)), 2 / 252)


def test_a_real_gap_resolves_and_names_the_faster_side():
    got = noise.compare([1.0, 1.1, 0.9, 1.05, 0.95], [2.0, 2.1, 1.9, 2.05, 1.95])
    assert got.resolved and got.faster == "a"
    assert got.describe().startswith("resolved (2.00x, 5 + 5 samples")


def test_too_few_samples_never_resolve_however_far_apart():
    got = noise.compare([1.0, 1.0, 1.0, 1.0], [9.0, 9.0, 9.0, 9.0])
    assert not got.resolved and got.faster is None
    assert got.describe().startswith("within noise (800% apart, 4 + 4 samples")


def test_same_sided_noise_stays_within_noise_almost_always():
    rng = random.Random(7)
    draws = [noise.compare([rng.gauss(1, 0.1) for _ in range(8)],
                           [rng.gauss(1, 0.1) for _ in range(8)]) for _ in range(400)]
    assert sum(c.resolved for c in draws) / len(draws) < 0.03


def test_rounds_stop_when_resolved_and_keep_going_while_not():
    rng = random.Random(3)
    apart = noise.Rounds(lambda: [rng.gauss(1, 0.02), rng.gauss(2, 0.02)],
                         lambda s: not noise.compare(*s).resolved, budget_s=60)
    assert [len(s) for s in apart.run()] == [5, 5]
    same = noise.Rounds(lambda: [1.0 + rng.random(), 1.0 + rng.random()],
                        lambda s: not noise.compare(*s).resolved, budget_s=60, max_rounds=9)
    got = same.run()
    assert len(got[0]) in range(5, 10) and not same.out_of_time


def test_rounds_stop_at_the_budget_but_never_below_the_minimum():
    rounds = noise.Rounds(lambda: [1.0, 1.0], lambda s: True, budget_s=0.0)
    assert [len(s) for s in rounds.run()] == [5, 5] and rounds.out_of_time


def test_the_median_interval_holds_the_true_median_as_often_as_it_says():
    # skewed noise (a step slowed by the load is far slower, never far faster): lognormal,
    # true median 1.0; the interval must cover it >= 95% of the time and narrow with n
    rng = random.Random(11)
    for n in (6, 12, 30):
        draws = [noise.median_interval([rng.lognormvariate(0, 0.2) for _ in range(n)])
                 for _ in range(2000)]
        assert sum(lo <= 1.0 <= hi for _, lo, hi in draws) / len(draws) >= 0.95
    widths = {n: sorted(hi - lo for _, lo, hi in (noise.median_interval(
        [rng.lognormvariate(0, 0.2) for _ in range(n)]) for _ in range(200)))[100]
        for n in (6, 30)}
    assert widths[30] < widths[6] / 2
    # order statistics 2 and 8 of 9 (P(Binomial(9, 1/2) < 2) = 10/512 <= 2.5%), median 5
    assert noise.median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (5, 2, 8)


def test_a_median_is_settled_once_its_interval_is_within_a_tenth_of_it():
    # a prediction's start (each plan's step) is used as a figure: timed until its median is
    # known to 10%, the sides still loose named for another round
    tight = [1.0, 1.02, 0.98, 1.01, 0.99]  # interval 0.98-1.02: +-2%
    loose = [1.0, 1.5, 0.7, 1.2, 0.9]  # 0.7-1.5: +-40%
    assert noise.unsettled({"a": tight, "b": loose}) == ["b"]
    assert noise.unsettled({"a": tight[:4]}) == ["a"]  # under MIN_SAMPLES: never settled
    # more of the same noise settles it: the 95% interval narrows with n
    rng = random.Random(3)
    many = [rng.lognormvariate(0, 0.15) for _ in range(40)]
    assert noise.unsettled({"a": many[:5]}) == ["a"] and noise.unsettled({"a": many}) == []
