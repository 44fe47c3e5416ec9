"""diag train's bar: the time left is diag's model, re-estimated from the steps' own pace."""

from types import SimpleNamespace

import pytest

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


def test_a_long_run_of_short_steps_gets_its_eta_and_an_evals_seconds_leave_the_pace(monkeypatch):
    # 5,000 steps of 0.5 s: a tenth of the run (500) is past the pace's 100-step window, so the
    # ETA comes after 2 min of steps; each eval (7 s, after every 50th step) is not a step's time
    from diag.qlora import trainer
    from diag.timing import StageTimer

    now, timer = [0.0], StageTimer()
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: now[0])
    progress = trainer.progress_callback()(timer, 100.0, 0, "test", {"train": 2500.0}, 0.0)
    state = SimpleNamespace(global_step=0, max_steps=5000)
    progress.on_train_begin(None, state, None)
    for step in range(1, 400):
        if step % 50 == 1 and step > 1:  # the eval the last step asked for
            timer.record("eval", 7.0)
            now[0] += 7.0
        now[0] += 0.5
        state.global_step = step
        progress.on_step_end(None, state, SimpleNamespace(should_evaluate=step % 50 == 0,
                                                          should_save=False))
        if progress.promised is not None:
            break
    progress.on_train_end(None, state, None)
    assert step == 241  # 240 steps of 0.5 s timed after the first: 2 min
    assert progress.promised == pytest.approx(now[0] + (5000 - 241) * 0.5)
