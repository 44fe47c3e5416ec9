"""Checkpointing on vs off decided on constructed frames (no step runs): off only where off is
resolved faster and the step's peak without it fits; within noise the naive plan's on is kept
and no saving is priced, at the plan's micro-batch or the naive one's."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from diag import noise
from diag.decision import CHECKPOINTING_HEADROOM
from diag.qlora.checkpointing import decide
from diag.qlora.plans import Plan

ALIKE = [1.0, 1.02, 0.98, 1.01, 0.99]  # on and off alike: a 1% jitter, nothing resolved
SLOWER = [1.5, 1.53, 1.47, 1.52, 1.48]  # on recomputes: 1.5x off, resolved at 5 + 5


def _frame(top: tuple[list[float], list[float]], naive: tuple[list[float], list[float]],
           peak_gb: float = 1.0) -> pd.DataFrame:
    """CPU seconds per step (on, off) at the plan's micro-batch 4 and the naive plan's 1."""
    rows = [{"gradient_checkpointing": on, "micro_batch": m, "seq_len": 64, "seconds": s,
             "cpu_s": s, "peak_mem_gb": peak_gb, "repeat": r}
            for m, sides in ((4, top), (1, naive)) for on, side in zip((True, False), sides)
            for r, s in enumerate(side)]
    return pd.DataFrame(rows)


def _decided(frame: pd.DataFrame, total_gb: float = 10.0):
    (d,) = decide(frame, "cpu", memory=(total_gb, "available host memory"), naive_micro_batch=1)
    return d, Plan.optimized([d]).gradient_checkpointing


def test_on_and_off_within_noise_keep_the_naive_plans_on_and_price_nothing():
    d, planned = _decided(_frame((ALIKE, list(reversed(ALIKE))), (ALIKE, ALIKE[1:] + ALIKE[:1])))
    assert (d.value, planned, d.resolved) == (True, True, False)
    assert "within noise" in d.why and "(the naive plan's, kept)" in d.why
    assert d.naive_ratio == 1.0 and d.saving_s() == 0


def test_off_resolved_faster_where_it_fits_turns_it_off_and_prices_the_ratio():
    d, planned = _decided(_frame((SLOWER, ALIKE), (SLOWER, ALIKE)))
    assert (d.value, planned, d.resolved) == (False, False, True)
    assert d.naive_ratio == pytest.approx(1.5 / 1.0) and d.saving_s() == pytest.approx(0.5)
    # at the naive micro-batch alike: its step is priced at 1.0, not at its medians' ratio
    mixed, _ = _decided(_frame((SLOWER, ALIKE), ([1.01, 1.03, 0.99, 1.02, 1.0], ALIKE)))
    assert mixed.value is False and mixed.naive_ratio == 1.0


@pytest.mark.parametrize("peak, fits", [(5.0, True), (5.01, False), (float("nan"), False)])
def test_off_is_taken_only_where_the_steps_peak_without_it_fits(peak, fits):
    assert CHECKPOINTING_HEADROOM * 10.0 == 5.0  # the limit these peaks sit at
    d, planned = _decided(_frame((SLOWER, ALIKE), (SLOWER, ALIKE), peak_gb=peak))
    assert (d.value, planned) == (not fits, not fits)
    assert d.why.endswith("; compared on CPU seconds")


@pytest.mark.parametrize("naive, said", [
    ((SLOWER, []), ""),  # the naive micro-batch timed on only: no ratio, nothing to say
    (([], ALIKE), ""),
    ((SLOWER, [0.0] * 5), "; at the naive micro-batch 1: a side took no time, no ratio priced"),
    (([0.5 * s for s in ALIKE], ALIKE), "; at the naive micro-batch 1: resolved (2.00x, 5 + 5 "
                                         "samples, spread 2% / 2%), no ratio priced"),
])
def test_the_naive_steps_ratio_needs_both_sides_timed_taking_time_and_on_slower(naive, said):
    d, planned = _decided(_frame((SLOWER, ALIKE), naive))
    assert (d.value, planned, d.naive_ratio) == (False, False, None)
    assert d.why.endswith(f"-> off{said}; compared on CPU seconds")


def test_a_priced_naive_ratio_says_what_it_rests_on():
    d, _ = _decided(_frame((SLOWER, ALIKE), (SLOWER, ALIKE)))
    assert "-> off; at the naive micro-batch 1: resolved (1.50x, 5 + 5 samples" in d.why
    assert "no ratio priced" not in d.why


def test_each_micro_batch_whose_gap_is_open_or_impossible_is_timed_again():
    from diag.qlora.checkpointing import pending

    faster = [0.5 * s for s in ALIKE]  # on faster than off: recomputing cannot be
    samples = {(0, 1, 1): SLOWER, (1, 1, 1): ALIKE,  # resolved: done
               (0, 4, 1): ALIKE, (1, 4, 1): ALIKE[::-1],  # within noise: again
               (0, 8, 1): faster, (1, 8, 1): ALIKE,  # the impossible way: again
               (0, 16, 1): ALIKE}  # off not timed yet at 16: nothing to compare
    assert pending(samples) == [(0, 4, 1), (1, 4, 1), (0, 8, 1), (1, 8, 1)]


@pytest.mark.parametrize("device, value, fallback", [
    ("cpu", False, "off, on CPU activations live in host RAM"),
    ("cuda:0", True, "on, the safe default on CUDA")])
def test_without_evidence_the_devices_safe_default_is_labelled_so(device, value, fallback):
    only_on = _frame((SLOWER, []), (SLOWER, []))
    only_off = _frame(([], ALIKE), ([], ALIKE))
    no_time = _frame(([0.0] * 5, ALIKE), (SLOWER, ALIKE))
    for frame, why in ((None, "checkpointing frame absent"),
                       (only_on.iloc[:0], "checkpointing frame absent"),
                       (only_on, "checkpointing was not timed both on and off"),
                       (only_off, "checkpointing was not timed both on and off"),
                       (no_time, "a checkpointing side took no time")):
        (d,) = decide(frame, device, memory=(10.0, "x"), naive_micro_batch=1)
        assert (d.setting, d.value, d.basis, d.source) == (
            "gradient_checkpointing", value, "default", "checkpointing")
        assert d.why == f"{why}: {fallback}"


def test_a_frame_without_micro_batches_is_decided_on_all_its_rows():
    frame = _frame((SLOWER, ALIKE), (SLOWER, ALIKE)).drop(columns="micro_batch")
    d, planned = _decided(frame)
    assert (d.value, planned, d.samples, d.naive_ratio) == (False, False, (10, 10), None)


def test_a_measured_decision_names_what_it_rests_on():
    from diag.decision import MeasuredOn

    on = MeasuredOn(model="tiny", device="cpu", tokens_per_step=512)
    for top, value, said in (((SLOWER, ALIKE), False, "-> off"),
                             ((ALIKE, ALIKE[::-1]), True, "-> on (the naive plan's, kept)")):
        (d,) = decide(_frame(top, (SLOWER, ALIKE)), "cpu", on, memory=(10.0, "host"),
                      naive_micro_batch=1, repeats_s=0.5)
        assert (d.setting, d.value, d.basis, d.source) == (
            "gradient_checkpointing", value, "measured", "checkpointing")
        assert (d.measured_on, d.baseline, d.stage, d.per) == (on, True, "compute", "step")
        assert (d.samples, d.repeats_s, d.resolved) == ((5, 5), 0.5, not value)
        assert d.spread == (noise.spread(top[0]), noise.spread(top[1]))
        assert re.search(rf"{re.escape(said)}; at the naive micro-batch 1: resolved \(1\.50x, "
                         r"5 \+ 5 samples, spread \d+% / \d+%\); 0\.5 s re-timing", d.why), d.why
        assert d.why.endswith("; 0.5 s re-timing; compared on CPU seconds")
    # on resolved faster than off: re-timed, then the default, never priced
    (d,) = decide(_frame((ALIKE, SLOWER), (SLOWER, ALIKE)), "cpu", on, memory=(10.0, "host"))
    assert (d.setting, d.value, d.basis, d.source) == (
        "gradient_checkpointing", False, "default", "checkpointing")
    # too big to go without it: on, and not the naive plan's keeping
    (d,) = decide(_frame((SLOWER, ALIKE), (SLOWER, ALIKE), peak_gb=9.0), "cpu", on,
                  memory=(10.0, "host"), naive_micro_batch=1)
    assert d.value is True and " -> on; at the naive" in d.why
