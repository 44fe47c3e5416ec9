"""Is a timed difference real? `compare(a, b)` resolves when an exact Mann-Whitney U test puts
p under ALPHA with MIN_SAMPLES a side; `choose` keeps the default unless the fastest's gap to it
resolves. `interleave` drives repeated rounds; `clock(device)` picks a comparison's clock.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

ALPHA = 0.01  # not 5%: Rounds looks after every round, each look a chance of a false gap
MIN_SAMPLES = 5  # per side: fewer cannot reach ALPHA however separated the samples are
SETTLED = 0.1  # a median is settled when its 95% interval's half-width is this share of it


@cache
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """How many of the C(m+n, m) orderings of two like samples give each U (0..mn)."""
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
    return min(1.0, 2 * sum(_u_counts(m, n)[: math.floor(tail) + 1]) / math.comb(m + n, m))


def spread(samples: Sequence[float]) -> float:
    """The samples' interquartile range over their median (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median and its distribution-free interval (under 6 values: the smallest, the largest)."""
    xs, n = sorted(values), len(values)
    k, tail = 0, 0.0
    while tail + math.comb(n, k) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    k = max(k, 1)
    return statistics.median(xs), xs[k - 1], xs[n - k]


def unsettled(samples: Mapping[Hashable, Sequence[float]], within: float = SETTLED) -> list[Any]:
    """The sides whose median is not yet known to `within` of itself, or under MIN_SAMPLES."""
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
        figures = f"{len(self.a)} + {len(self.b)} samples, spread {spread(self.a):.0%} / " \
                  f"{spread(self.b):.0%}"
        if self.resolved:
            return f"resolved ({max(self.ratio, 1 / self.ratio):.2f}x, {figures})"
        return f"within noise ({abs(self.ratio - 1) * 100:.0f}% apart, {figures})"

    def sure(self) -> dict[str, Any]:
        """A Decision's how-sure fields: samples and spread (a's first), resolved."""
        return {"samples": (len(self.a), len(self.b)), "spread": (spread(self.a), spread(self.b)),
                "resolved": self.resolved}


def compare(a: Sequence[float], b: Sequence[float]) -> Comparison:
    return Comparison(tuple(a), tuple(b))


def fastest(samples: Mapping[Hashable, Sequence[float]]) -> Any:
    """The side with the lowest median (the first listed among equals)."""
    return min(samples, key=lambda k: statistics.median(samples[k]))


def unresolved(samples: Mapping[Hashable, Sequence[float]]) -> list[Any]:
    """The sides within noise of the fastest, the fastest first (empty: every gap is real)."""
    best = fastest(samples)
    tied = [k for k in samples if k != best and not compare(samples[best], samples[k]).resolved]
    return [best, *tied] if tied else []


@dataclass(frozen=True)
class Choice:
    """`choose`'s decision: the value, the fastest, those tied with it, the comparison to rival."""
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
    """The fastest side when its gap to `default` is resolved, else `default` (the simpler)."""
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
    """Rounds of `round()` until not `pending(samples)` or budget_s is spent past `owed` rounds."""

    def __init__(self, round: Callable[[], Sequence[float]],
                 pending: Callable[[list[list[float]]], object], *, budget_s: float,
                 max_rounds: int = 16, min_rounds: int = MIN_SAMPLES, owed: int = 0) -> None:
        self.round, self.pending = round, pending
        self.budget_s, self.max_rounds, self.min_rounds = budget_s, max_rounds, min_rounds
        self.owed, self.spent_s, self.out_of_time = owed, 0.0, False

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


def interleave(sides: Sequence[Hashable], measure: Callable[[Any, int], Any],
               pending: Callable[[dict[Any, list[Any]]], object] = lambda got: True, *,
               budget_s: float = math.inf, min_rounds: int = MIN_SAMPLES, max_rounds: int = 16,
               owed: int = 0) -> tuple[dict[Any, list[Any]], Rounds]:
    """Rounds of `measure(side, round)` on every side, order turned: (returns by side, Rounds)."""
    got: dict[Any, list[Any]] = {side: [] for side in sides}
    turns = itertools.count()

    def one_round() -> list[Any]:
        n = next(turns)
        for side in list(sides) if n % 2 == 0 else list(sides)[::-1]:
            got[side].append(measure(side, n))
        return [got[side][-1] for side in sides]

    rounds = Rounds(one_round, lambda _: pending(got), budget_s=budget_s, min_rounds=min_rounds,
                    max_rounds=max_rounds, owed=owed)
    rounds.run()
    return got, rounds


@dataclass(frozen=True)
class Clock:
    """What a comparison compares seconds on: its name, a timed row's column, its unit."""
    name: str  # "CPU" or "wall"
    column: str  # "cpu_s" or "seconds"
    unit: str  # "CPU s" or "s"

    def __str__(self) -> str:
        return "CPU seconds" if self.name == "CPU" else "wall seconds"

    def col(self, wall: str = "seconds") -> str:
        """The column of a frame whose wall seconds are `wall` that holds this clock."""
        return self.column if self.name == "CPU" else wall


WALL, CPU = Clock("wall", "seconds", "s"), Clock("CPU", "cpu_s", "CPU s")


def clock(device: Any) -> Clock:
    """CPU seconds on a CPU (a shared box's wall moves with its neighbours), else wall."""
    return CPU if str(device).split(":")[0] == "cpu" else WALL
