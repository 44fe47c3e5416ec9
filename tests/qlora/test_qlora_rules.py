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




def test_the_rounds_go_on_past_cfg_rounds_until_the_headline_resolves(monkeypatch):
    # each round's naive run costs twice the optimized one: at 5 rounds a side the gap
    # resolves and the rounds stop; with no budget they stop at cfg.rounds; a single round
    # (a quick look) is never extended
    import pandas as pd

    from diag.config import QLoraConfig
    from diag.forecast.costs import measured, row
    from diag.qlora import experiment, job
    from diag.qlora.job import PlanRun
    from diag.qlora.plans import Plan

    def run_plan(cfg, plan, src, bases, rnd):
        seconds = (2.0 if plan.name == "naive" else 1.0) * (1 + 0.01 * rnd)
        costs = measured([row(plan.name, "train", "slot", seconds, 100, clock="CPU", rnd=rnd)])
        return PlanRun(plan.name, rnd, pd.DataFrame(), pd.DataFrame(), costs,
                       {"real_tokens": 100, "plan": plan.name})

    monkeypatch.setattr(job, "run_plan", run_plan)
    plans = [Plan.naive(), Plan.optimized()]
    got = experiment._rounds(QLoraConfig.quick(rounds=2), plans, None, None, "CPU", 60.0)
    assert [r.round for r in got if r.plan == "naive"] == [0, 1, 2, 3, 4]
    assert [r.plan for r in got[:4]] == ["naive", "optimized", "optimized", "naive"]
    assert len(experiment._rounds(QLoraConfig.quick(rounds=2), plans, None, None, "CPU",
                                  0.0)) == 4
    assert len(experiment._rounds(QLoraConfig.quick(rounds=1), plans, None, None, "CPU",
                                  60.0)) == 2
