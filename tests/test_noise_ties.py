"""diag.noise on a coarse clock: ties count a half (identical sides are never "resolved"), and a
gap needs MIN_SAMPLES on each side, however separated the fewer samples are."""

from __future__ import annotations

import math

import pytest

from diag import noise


def test_identical_sides_are_within_noise_whatever_their_size():
    # a coarse clock reads every step the same: nothing tells the sides apart
    for n in (5, 6, 12):
        same = noise.compare([0.01] * n, [0.01] * n)
        assert same.p == 1.0 and not same.resolved and same.faster is None
        assert same.describe().startswith(f"within noise (0% apart, {n} + {n} samples")


def test_ties_count_a_half_so_the_test_is_the_same_either_way_round():
    # a clock of 10 ms ticks: most samples tie across the sides
    a, b = [0.01, 0.01, 0.02, 0.02, 0.02, 0.01], [0.02, 0.02, 0.01, 0.03, 0.02]
    assert noise.u_test(a, b) == noise.u_test(b, a)
    # one tie between two otherwise separated sides: U = 0.5, which floors to the U = 0 tail
    assert math.isclose(noise.u_test([1.0] * 4 + [2.0], [2.0] + [3.0] * 4), 2 / 252)
    # every value of a tied with one of b: U = 5 x 0.5 = 2.5, the tail of U <= 2 (4 orderings)
    tied = noise.u_test([1.0] * 5, [1.0] + [2.0] * 4)
    assert math.isclose(tied, 2 * 4 / 252) and not noise.compare([1.0] * 5,
                                                                 [1.0] + [2.0] * 4).resolved


def test_the_default_is_kept_where_the_fastest_only_ties_it():
    samples = {"default": [0.01] * 6, "other": [0.01] * 6}
    got = noise.choose(samples, "default")
    assert got.value == "default" and not got.resolved
    assert noise.unresolved(samples) == ["default", "other"]


@pytest.mark.parametrize("m, n", [(4, 6), (3, 10), (4, 16), (2, 40)])
def test_too_few_samples_on_either_side_never_resolve(m, n):
    fast, slow = [1.0 + 0.01 * i for i in range(m)], [5.0 + 0.01 * i for i in range(n)]
    for a, b in ((fast, slow), (slow, fast)):
        got = noise.compare(a, b)
        assert got.p < noise.ALPHA  # the rank test alone would call it real
        assert not got.resolved and got.faster is None
    assert noise.choose({"naive": slow, "fix": fast}, "naive").value == "naive"


def test_the_fewest_samples_that_resolve_are_five_a_side():
    fast, slow = [1.0 + 0.01 * i for i in range(5)], [5.0 + 0.01 * i for i in range(6)]
    assert noise.compare(fast, slow).resolved and noise.compare(slow, fast).faster == "b"
    assert noise.choose({"naive": slow, "fix": fast}, "naive").value == "fix"
