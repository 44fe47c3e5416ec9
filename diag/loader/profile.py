"""Which line of the preprocessing costs the time: line_profiler over one function.

`profile_lines(fn, samples)` calls `fn(sample)` for each sample under line_profiler and returns
one row per line of fn that ran: `line` (number in its file), `hits`, `seconds` (total),
`share` (of the function's measured time), `source`. Sort by `seconds` for the hot lines; the
profiler adds a little time to every line, so read shares, not absolute microseconds.
"""

from __future__ import annotations

import inspect
import linecache
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = ["line", "hits", "seconds", "share", "us_per_hit", "source", "function"]


def profile_lines(fn: Callable[[Any], Any], samples: Iterable[Any], warmup: bool = True
                  ) -> pd.DataFrame:
    """Run fn over samples under line_profiler: the per-line table, in source order.

    warmup: call fn on the first sample once before profiling, so one-time costs (imports, a
    tokenizer load, caches) do not land on the line that first pays them.
    """
    import pandas as pd
    from line_profiler import LineProfiler

    target = getattr(fn, "__func__", fn)  # a bound method: profile the function it wraps
    if not inspect.isfunction(target):
        raise ValueError(f"fn={fn!r}: profile_lines needs a Python function or method "
                         "(builtins and C extensions have no lines to profile)")
    samples = list(samples)
    if warmup and samples:
        fn(samples[0])
    profiler = LineProfiler()
    profiler.add_function(target)
    profiler.enable_by_count()
    calls = 0
    try:
        for sample in samples:
            fn(sample)
            calls += 1
    finally:
        profiler.disable_by_count()
    if not calls:
        raise ValueError("samples is empty: give at least one sample to call fn with")
    stats = profiler.get_stats()
    rows = []
    for (filename, _, name), timings in stats.timings.items():
        for lineno, hits, total in timings:
            seconds = total * stats.unit
            rows.append({"line": lineno, "hits": hits, "seconds": seconds,
                         "us_per_hit": seconds / hits * 1e6 if hits else float("nan"),
                         "source": linecache.getline(filename, lineno).strip(),
                         "function": name})
    frame = pd.DataFrame(rows, columns=COLUMNS).sort_values("line", ignore_index=True)
    total = frame["seconds"].sum()
    frame["share"] = frame["seconds"] / total if total > 0 else 0.0
    return frame
