"""The micro-batch decision when the naive point (micro-batch 1) did not run: the reference is
the most accumulation that did run, kept unless another point is resolved faster than it;
constructed frames (no step runs), the decision and the summary's `recommended` alike."""

from __future__ import annotations

import pandas as pd

from diag.accum import accum_frame, decide, summarize
from diag.decision import MeasuredOn
from diag.qlora.plans import Plan

ALIKE = [1.0, 1.02, 0.98, 1.01, 0.99]  # a 1% jitter: no two points resolve


def _sweep(cpu: dict[int, list[float]], failed: tuple[int, ...] = (1,)) -> pd.DataFrame:
    """8 rows per optimizer step: a point per micro-batch, one row per timed step."""
    rows = [{"step": 0, "micro_batch": m, "grad_accum": 8 // m, "status": "oom", "repeat": 0,
             "seconds_per_step": float("nan"), "cpu_s": float("nan"), "data_s": 0.0,
             "peak_mem_gb": float("nan"), "warmup_s": float("nan"), "detail": "out of memory"}
            for m in failed]
    rows += [{"step": 0, "micro_batch": m, "grad_accum": 8 // m, "status": "ok", "repeat": r,
              "seconds_per_step": s, "cpu_s": s, "data_s": 0.0, "peak_mem_gb": 0.1 * m,
              "warmup_s": 2.0, "detail": ""}
             for m, side in cpu.items() for r, s in enumerate(side)]
    return accum_frame(pd.DataFrame(rows), 8 * 64)


def _picked(frame: pd.DataFrame) -> tuple[int, int, int]:
    (d,) = decide(frame, MeasuredOn(device="cpu"))
    table = summarize(frame, device="cpu")
    marked = int(table.loc[table["recommended"], "micro_batch"].item())
    return d.value, marked, Plan.optimized([d]).micro_batch


def test_with_the_naive_point_failed_and_the_rest_alike_the_most_accumulation_is_kept():
    frame = _sweep({2: ALIKE, 4: ALIKE[::-1], 8: ALIKE[1:] + ALIKE[:1]})
    assert _picked(frame) == (2, 2, 2)
    (d,) = decide(frame, MeasuredOn(device="cpu"))
    assert not d.resolved and "(the most accumulation swept)" in d.why
    assert d.naive_ratio is None and d.baseline_s is None  # the naive step was not timed


def test_with_the_naive_point_failed_a_point_resolved_faster_than_the_reference_is_taken():
    faster = [0.5 * s for s in ALIKE]
    assert _picked(_sweep({2: ALIKE, 4: faster, 8: ALIKE})) == (4, 4, 4)
    # the smallest point that ran is the reference wherever it sits in the sweep's order
    assert _picked(_sweep({8: ALIKE, 4: ALIKE, 2: ALIKE}))[:2] == (2, 2)


def test_with_the_naive_point_timed_it_is_the_reference():
    frame = _sweep({1: ALIKE, 2: ALIKE, 8: [0.9 * s for s in ALIKE]}, failed=())
    (d,) = decide(frame, MeasuredOn(device="cpu"))
    assert (d.value, d.baseline) == (8, 1) and d.resolved
    assert _picked(_sweep({1: ALIKE, 2: ALIKE, 8: ALIKE}, failed=()))[:2] == (1, 1)
