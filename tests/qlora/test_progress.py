"""diag train's bar: the time left is diag's model, re-estimated from the steps' own pace."""

from diag.qlora.trainer import left_s

PROJECTED = {"fetch_data": 5.0, "load_model": 20.0, "setup": 2.0, "warmup": 4.0,
             "train": 100.0, "checkpoint": 6.0, "eval": 12.0}


def test_the_time_left_follows_the_pace_the_steps_run_at():
    spent = {"fetch_data": 5.0, "load_model": 21.0, "setup": 2.0, "warmup": 4.0,
             "checkpoint": 2.0, "eval": 3.0}
    # 104 steps priced at 1 s each; 50 left at 1.5 s: the evals priced at that pace too (a busier
    # box slows a forward pass as it slows a step), the saves (disk) as priced, less what is spent
    assert left_s(PROJECTED, spent, 50, 1.5, 104) == 50 * 1.5 + (6.0 - 2.0) + (12.0 * 1.5 - 3.0)
    # the same run going twice as fast: half the steps' and the evals' time left
    assert left_s(PROJECTED, spent, 50, 0.75, 104) == 50 * 0.75 + 4.0 + (12.0 * 0.75 - 3.0)
    # no step timed yet: the ETA's own price of the steps; a stage past its ETA adds nothing
    assert left_s(PROJECTED, {"eval": 30.0}, 100, None, 104) == 104.0 + 6.0
