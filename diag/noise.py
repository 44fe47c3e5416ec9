"""Is a timed difference real? Two sides' samples (seconds, or any figure where less is better),
judged by a rank test, never by one timing each.

`compare(a, b)` is resolved when a two-sided Mann-Whitney U test (exact, no normal
approximation: the samples are few) puts the chance of a gap at least this large between two
sides that are really the same under `ALPHA`, with at least `MIN_SAMPLES` per side (5 + 5 is the
fewest where complete separation clears 1%: p = 2/252). A rank test needs no assumption about the
shape of the noise, and one slow outlier (a load spike on a shared box) moves it by one rank, not
by its size. An unresolved comparison keeps the simpler setting (the caller's default) and says
"within noise (x% apart, n + m samples)".

`Rounds` drives the repeats: a measurement round gives one sample per side (interleaved, so a
load change hits both); rounds go on until every comparison the caller asks about is resolved, or
`max_rounds`, or the time budget is spent. `unresolved(samples)` names the sides a round should
re-time (those not resolved from the fastest); `choose(samples, default)` is the decision: the
fastest side where its gap to the default is resolved, else the default. `unsettled(samples)`
names the sides whose median, a figure used as it is rather than compared, is not yet known to
`SETTLED` of itself.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

# A difference is real when two same-distributed sides show a gap this large this seldom. 1%, not
# 5%: `Rounds` looks after every round, and each look is another chance of a false "resolved"
# (simulated, sides equal with 10% noise, looks at 5..16 rounds: 3.5% end resolved at 1%, 16% at
# 5%); a 10% gap under that noise resolves in 60% of runs within 16 rounds, the rest keep the
# default as "within noise".
ALPHA = 0.01
MIN_SAMPLES = 5  # per side: fewer cannot reach ALPHA however separated the samples are
# a median used as a figure is settled when its 95% interval's half-width is this share of it
SETTLED = 0.1


@cache
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """How many of the C(m+n, m) orderings of two same-distributed samples give each U (0..mn)."""
    if m == 0 or n == 0:
        return (1,)
    # the largest value is from the first sample (it beats all n) or from the second
    first, second = _u_counts(m - 1, n), _u_counts(m, n - 1)
    return tuple((first[u - n] if 0 <= u - n < len(first) else 0)
                 + (second[u] if u < len(second) else 0) for u in range(m * n + 1))


def u_test(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided exact p-value of the Mann-Whitney U test (ties count a half)."""
    m, n = len(a), len(b)
    if not m or not n:
        return 1.0
    u = sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)
    tail = min(u, m * n - u)
    counts = _u_counts(m, n)
    return min(1.0, 2 * sum(counts[: math.floor(tail) + 1]) / math.comb(m + n, m))


def spread(samples: Sequence[float]) -> float:
    """The samples' interquartile range over their median (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median and its distribution-free interval (no assumption on the noise's shape): order
    statistics k and n-k+1, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2. Under
    6 values no pair reaches 95%: the interval is then the smallest and largest (5: 93.8%)."""
    xs, n = sorted(values), len(values)
    k, tail = 0, 0.0
    while tail + math.comb(n, k) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    k = max(k, 1)
    return statistics.median(xs), xs[k - 1], xs[n - k]


def unsettled(samples: Mapping[Hashable, Sequence[float]], within: float = SETTLED
              ) -> list[Any]:
    """The sides whose median is not yet known to `within` of itself (median_interval's
    half-width over the median), or that hold under MIN_SAMPLES: a figure used as it is (a
    prediction's start), not compared."""
    out = []
    for side, values in samples.items():
        mid, lo, hi = median_interval(values)
        if len(values) < MIN_SAMPLES or (hi - lo) / 2 > within * abs(mid):
            out.append(side)
    return out


@dataclass(frozen=True)
class Comparison:
    """Side a against side b: their medians, spreads and whether the gap is resolved."""

    a: tuple[float, ...]
    b: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """b's median over a's (b is slower above 1)."""
        return statistics.median(self.b) / statistics.median(self.a)

    @property
    def p(self) -> float:
        return u_test(self.a, self.b)

    @property
    def resolved(self) -> bool:
        return min(len(self.a), len(self.b)) >= MIN_SAMPLES and self.p < ALPHA

    @property
    def faster(self) -> str | None:
        """"a" or "b" when resolved, else None."""
        return None if not self.resolved else "a" if self.ratio > 1 else "b"

    def describe(self) -> str:
        """One line: "resolved (1.84x, 6 + 6 samples, spread 3% / 5%)" or "within noise (...)"."""
        apart = abs(self.ratio - 1) * 100
        figures = (f"{len(self.a)} + {len(self.b)} samples, spread "
                   f"{spread(self.a):.0%} / {spread(self.b):.0%}")
        if self.resolved:
            return f"resolved ({max(self.ratio, 1 / self.ratio):.2f}x, {figures})"
        return f"within noise ({apart:.0f}% apart, {figures})"


def compare(a: Sequence[float], b: Sequence[float]) -> Comparison:
    return Comparison(tuple(a), tuple(b))


def fastest(samples: Mapping[Hashable, Sequence[float]]) -> Any:
    """The side with the lowest median (the first listed among equals)."""
    return min(samples, key=lambda k: statistics.median(samples[k]))


def unresolved(samples: Mapping[Hashable, Sequence[float]]) -> list[Any]:
    """The sides whose gap to the fastest is not resolved (empty: every gap is real); the
    fastest is listed first when any is, so a round re-times it beside them."""
    best = fastest(samples)
    tied = [k for k in samples if k != best and not compare(samples[best], samples[k]).resolved]
    return [best, *tied] if tied else []


@dataclass(frozen=True)
class Choice:
    """What `choose` decided: `value`, the fastest side `best`, the sides within noise of it
    (`tied`) and `against`: the fastest (a) against `rival` (b): the default, or, when the
    default is the fastest, the runner-up (None: one side only)."""

    value: Any
    default: Any
    best: Any
    tied: tuple[Any, ...]
    against: Comparison | None
    rival: Any = None

    @property
    def resolved(self) -> bool:
        """The choice rests on a real gap (a kept default that is the fastest: to its runner-up)."""
        return self.against is not None and self.against.resolved


def choose(samples: Mapping[Hashable, Sequence[float]], default: Hashable) -> Choice:
    """The fastest side when its gap to `default` is resolved, else `default` (kept: the
    simpler setting); `default` must be one of the sides."""
    best = fastest(samples)
    tied = tuple(k for k in unresolved(samples) if k != best)
    if best != default:
        gap = compare(samples[best], samples[default])
        return Choice(best if gap.resolved else default, default, best, tied, gap, default)
    others = {k: v for k, v in samples.items() if k != default}
    runner = fastest(others) if others else None
    return Choice(default, default, best, tied,
                  compare(samples[default], others[runner]) if others else None, runner)


class Rounds:
    """Repeats of a measurement, one round at a time, until resolved or out of time.

    `round()` returns one sample per side (a list, interleaved inside the round by the caller);
    `pending(samples)` returns which comparisons are still unresolved (falsy: done). Rounds run at
    least `min_rounds` times, at most `max_rounds`, and stop once `budget_s` seconds are spent
    (checked between rounds, so a round is never cut in half) past the first `owed` rounds (a
    screen's share, not repeats: `spent_s` leaves them out too)."""

    def __init__(self, round: Callable[[], Sequence[float]],
                 pending: Callable[[list[list[float]]], object], *, budget_s: float,
                 max_rounds: int = 16, min_rounds: int = MIN_SAMPLES, owed: int = 0) -> None:
        self.round, self.pending = round, pending
        self.budget_s, self.max_rounds, self.min_rounds = budget_s, max_rounds, min_rounds
        self.owed = owed
        self.spent_s = 0.0
        self.out_of_time = False

    def run(self) -> list[list[float]]:
        samples: list[list[float]] = []
        start = time.perf_counter()
        for n in range(self.max_rounds):
            got = self.round()
            samples = samples or [[] for _ in got]
            for side, value in zip(samples, got, strict=True):
                side.append(value)
            now = time.perf_counter()
            if n + 1 <= self.owed:
                start = now
            self.spent_s = now - start
            if n + 1 >= self.min_rounds and not self.pending(samples):
                break
            if self.spent_s >= self.budget_s and n + 1 >= self.min_rounds:
                self.out_of_time = True
                break
        return samples
