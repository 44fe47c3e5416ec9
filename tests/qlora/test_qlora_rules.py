"""diag.qlora's own rules on constructed frames (no model, no run): checkpointing decided at the
micro-batch the plan runs, and each plan's seconds the median of its interleaved rounds."""

from __future__ import annotations

import pandas as pd
import pytest

from diag.qlora.checkpointing import decide


def _steps(micro: int, on_s: float, off_s: float, peak_off_gb: float, repeats: int = 5) -> list:
    """On/off rows at one micro-batch, alternating as the harness times them, with a little
    spread so a noise rule sees samples that resolve."""
    return [{"gradient_checkpointing": on, "micro_batch": micro, "seq_len": 128,
             "seconds": (s := (on_s if on else off_s) * (1 + 0.01 * r)), "cpu_s": s,
             "peak_mem_gb": peak_off_gb / 3 if on else peak_off_gb, "repeat": r}
            for r in range(repeats) for on in (True, False)]


def test_checkpointing_is_decided_and_priced_at_the_plans_micro_batch():
    # at micro-batch 1 (the naive plan's) the step without checkpointing peaks at 2 GB, at 8
    # (the plan's) at 30 GB: of 40 GB, over the 50% headroom only at 8, so it stays on, and
    # its price is the on/off seconds at 8; micro-batch 1's ratio prices the naive step
    frame = pd.DataFrame(_steps(1, 1.2, 1.0, 2.0) + _steps(8, 3.0, 2.0, 30.0))
    (got,) = decide(frame, "cpu", memory=(40.0, "test memory"), naive_micro_batch=1)
    assert got.value is True and "30 GB of 40 GB" in got.why
    assert got.baseline_s == pytest.approx(3.0, rel=0.03)
    assert got.chosen_s == pytest.approx(3.0, rel=0.03)
    assert got.naive_ratio == pytest.approx(1.2, rel=0.03)


