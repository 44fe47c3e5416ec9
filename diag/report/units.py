"""Numbers as a person reads them: 3 significant figures, the unit read from the column's name.

`cell("step_s", 0.01804)` is `18.0 ms`, `cell("data_wait_share", 0.0064)` is `0.640%`; a column
without a unit keeps its number (integers with thousands separators).
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

_PARTS = re.compile(r"[a-z0-9]+")
_SPACE = "\u00a0"  # a figure and its unit never wrap apart
# (largest value shown in this unit, the unit's size, its name): the first that holds it wins
_DURATIONS = ((1e-3, 1e-6, "µs"), (1.0, 1e-3, "ms"), (120.0, 1.0, "s"), (7200.0, 60.0, "min"),
              (math.inf, 3600.0, "h"))
_BYTES = ((1e3, 1.0, "B"), (1e6, 1e3, "kB"), (1e9, 1e6, "MB"), (1e12, 1e9, "GB"),
          (math.inf, 1e12, "TB"))
_COUNTS = ((1e3, 1.0, ""), (1e6, 1e3, "k"), (1e9, 1e6, "M"), (math.inf, 1e9, "G"))
# words in a column's name -> the scale of its values, the ladder to show them on
_SCALED = (({"us"}, 1e-6, _DURATIONS), ({"ms"}, 1e-3, _DURATIONS),
           ({"hours"}, 3600.0, _DURATIONS), ({"s", "seconds"}, 1.0, _DURATIONS),
           ({"gb"}, 1e9, _BYTES), ({"bytes"}, 1.0, _BYTES))


def sig(x: float) -> str:
    """3 significant figures, trailing zeros kept (18.0, 0.145, 100), no exponent."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:#.3g}".rstrip(".")


def _ladder(value: float, ladder: tuple[tuple[float, float, str], ...]) -> str:
    if value == 0:  # 0 s, 0 B
        return f"0{_SPACE}{next(unit for _, size, unit in ladder if size == 1.0)}".rstrip()
    for top, size, unit in ladder:
        # the rounded figure picks the rung: 999.7 ms shows as 1.00 s
        if abs(float(sig(value / size).replace(",", ""))) < top / size:
            return f"{sig(value / size)}{_SPACE}{unit}".rstrip()
    return sig(value)


def seconds(value: float) -> str:
    """A duration in the unit that reads best: 36.9 µs, 18.0 ms, 3.03 s, 11.0 min, 9.50 h."""
    return _ladder(float(value), _DURATIONS)


def share(value: float) -> str:
    return f"{sig(float(value) * 100)}%"


def cell(column: str, value: Any) -> str:
    """value as shown under column: with its unit when the name carries one."""
    import pandas as pd

    if value is None or pd.api.types.is_scalar(value) and pd.isna(value):  # NaN, NA, NaT: blank
        return ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    words = _PARTS.findall(column.lower())
    if "usd" in words:
        return f"${value:,.2f}"
    if len(words) > 2 and words[-2:] == ["per", "s"]:  # tokens_per_s, mb_per_s: a rate
        what = " ".join(words[:-2])
        if what == "mb":
            return _ladder(value * 1e6, _BYTES) + "/s"
        return f"{_ladder(value, _COUNTS).replace(_SPACE, '')}{_SPACE}{what}/s"  # 1.58k tokens/s
    if words and words[-1] in ("share", "fraction", "mfu") or words[:2] == ["share", "of"]:
        return share(value)
    for names, scale, ladder in _SCALED:
        if names & set(words):
            return _ladder(value * scale, ladder)
    if float(value).is_integer():
        return f"{int(value):,}"
    return sig(value)
