"""Which line of the preprocessing costs the time: line_profiler over one function, a row per
line that ran. The profiler adds a little to every line: read shares, not microseconds."""
from __future__ import annotations

import inspect
import linecache
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd
from line_profiler import LineProfiler

COLUMNS = ["line", "hits", "seconds", "share", "us_per_hit", "source", "function"]


def profile_lines(fn: Callable[[Any], Any], samples: Iterable[Any], warmup: bool = True
                  ) -> pd.DataFrame:
    """fn over samples under line_profiler, in source order; warmup: one unprofiled call first."""
    target = getattr(fn, "__func__", fn)  # a bound method: profile the function it wraps
    if not inspect.isfunction(target):
        raise ValueError(f"fn={fn!r}: profile_lines needs a Python function or method "
                         "(builtins and C extensions have no lines to profile)")
    samples = list(samples)
    if not samples:
        raise ValueError("samples is empty: give at least one sample to call fn with")
    if warmup:
        fn(samples[0])
    profiler = LineProfiler()
    profiler.add_function(target)
    profiler.enable_by_count()
    try:
        for sample in samples:
            fn(sample)
    finally:
        profiler.disable_by_count()
    stats = profiler.get_stats()
    rows = [{"line": line, "hits": hits, "seconds": total * stats.unit,
             "us_per_hit": total * stats.unit / hits * 1e6 if hits else float("nan"),
             "source": linecache.getline(filename, line).strip(), "function": name}
            for (filename, _, name), timings in stats.timings.items()
            for line, hits, total in timings]
    frame = pd.DataFrame(rows, columns=COLUMNS).sort_values("line", ignore_index=True)
    total = frame["seconds"].sum()
    frame["share"] = frame["seconds"] / total if total > 0 else 0.0
    return frame
