"""Decisions that hold: a step whose timing the test controls (the clocks the harness reads,
wall and CPU, advance by the step's schedule, nothing else) driven through the harness diag's
decisions use (train_points, retime, decide), the step's own memory, and the checkpointing
rule's impossible case. A real gap resolves; sides alike keep the default; on a CPU the CPU
seconds decide, whatever the wall clock says."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from pathlib import Path

import pandas as pd
import pytest
from types import SimpleNamespace
import torch

from diag.accum import accum_frame, decide, retime, train_points
from diag.accum.sweep import PeakMemory
from diag.decision import MeasuredOn
from diag.noise import unresolved

WIDTH = 64  # the fake model's features: a micro-step saves its input and its ReLU output
ROWS = 4  # rows per optimizer step: points (1, 4), (2, 2), (4, 1)


class Clock:
    """time.perf_counter (`now`) and time.process_time (`cpu`) for the test: they move only
    when a step says it took time."""

    def __init__(self) -> None:
        self.now = self.cpu = 0.0


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)  # the harness's and Rounds'
    monkeypatch.setattr(time, "process_time", lambda: clock.cpu)  # budget alike
    return clock


class ClockStep:
    """An AccumStep (diag.accum.sweep) on a two-layer MLP whose optimizer step takes what the
    test says: `schedule[micro][n]` CPU seconds of `clock` for that micro-batch's n-th step
    (cycled), and as many wall seconds, or `wall[micro][n]` where given (a scheduler's share),
    so the timings, not a busy machine, decide what a rule sees."""

    def __init__(self, schedule: dict[int, list[float]], clock: Clock | None = None,
                 wall: dict[int, list[float]] | None = None) -> None:
        self.clock = clock
        self.wall = {m: itertools.cycle(s) for m, s in (wall or schedule).items()}
        self.device = torch.device("cpu")
        self.model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                         torch.nn.Linear(WIDTH, WIDTH))
        self.schedule = {m: itertools.cycle(s) for m, s in schedule.items()}
        self.optimizer = None
        self._micro = 0

    def batches(self, micro_batch: int):
        return contextlib.nullcontext(itertools.repeat(torch.ones(micro_batch, WIDTH)))

    def reset(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters())

    def backward(self, batch: torch.Tensor, scale: float) -> None:
        self._micro = batch.shape[0]
        (self.model(batch).sum() * scale).backward()

    def no_sync(self):
        return contextlib.nullcontext()

    def update(self) -> None:
        took, waited = next(self.schedule[self._micro]), next(self.wall[self._micro])
        if self.clock:
            self.clock.cpu += took
            self.clock.now += waited
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _decided(schedule: dict[int, list[float]], clock: Clock, budget_s: float = 2.0,
             wall: dict[int, list[float]] | None = None, device: str = "cpu"):
    step = ClockStep(schedule, clock, wall)
    timed = train_points([step], [(m, ROWS // m) for m in schedule], repeats=5, warmup_steps=1)
    timed, spent = retime([step], timed, unresolved, budget_s=budget_s)
    (got,) = decide(accum_frame(timed, ROWS * 8), MeasuredOn(device=device), repeats_s=spent)
    return got, timed


def _ms(*values: float) -> list[float]:
    return [v / 1e3 for v in values]


def test_a_real_two_fold_gap_resolves_and_sides_alike_keep_the_naive_micro_batch(clock):
    # 2 and 4 as fast as each other, 1 twice as slow: resolved, never called noise; of the tied
    # two, the least accumulation (4 x 1: the Trainer pays per micro-batch)
    fast = _ms(10, 11, 12, 13, 14)
    got, timed = _decided({1: [2 * s for s in fast], 2: fast, 4: fast}, clock)
    assert (got.value, got.resolved, got.basis, got.tied) == (4, True, "measured", (2,))
    assert (got.baseline_s, got.chosen_s, got.clock) == (pytest.approx(0.024),
                                                         pytest.approx(0.012), "CPU")
    assert "micro-batch 4 x 1 (0.012 CPU s per step) against micro-batch 1 x 4 (0.024 CPU s " \
           "per step): resolved (2.00x" in got.why
    assert "within noise of the fastest, micro-batch 2 x 2 (0.012 CPU s per step): the least " \
           "accumulation of them" in got.why
    assert got.why.endswith("; compared on CPU seconds")
    assert "; within noise of the fastest: micro-batch 2" in got.why
    # 2 and 4 stay tied: re-timed until the budget (0.012 s a step, 2 s) or 16 rounds ran out
    assert timed.groupby("micro_batch")["repeat"].max().to_dict() == {1: 4, 2: 20, 4: 20}
    # every point the same schedule: no gap resolves, 1 is kept, within noise
    alike, timed = _decided({m: fast for m in (1, 2, 4)}, clock, budget_s=0.3)
    assert (alike.value, alike.resolved) == (1, False)
    assert alike.baseline_s == alike.chosen_s == pytest.approx(0.012)
    assert "(the naive plan's) is the fastest of 3 points" in alike.why
    assert "within noise (0% apart" in alike.why
    # the budget stops the rounds between rounds: past 0.3 s by less than one round (3 steps)
    assert 0.3 <= alike.repeats_s < 0.3 + 3 * 0.014
    assert f"{alike.repeats_s:.2g} s re-timing the finalists" in alike.why


def test_on_a_cpu_the_steps_cpu_seconds_decide_and_price_the_wall_ones_stay_in_the_rows(clock):
    # micro-batch 4 costs half the CPU of 1, but the scheduler makes its wall time twice as long
    cpu = _ms(10, 11, 12, 13, 14)
    got, timed = _decided({1: [2 * s for s in cpu], 4: cpu}, clock,
                          wall={1: cpu, 4: [2 * s for s in cpu]})
    assert (got.value, got.resolved) == (4, True)
    assert "micro-batch 4 x 1 (0.012 CPU s per step)" in got.why
    frame = accum_frame(timed, ROWS * 8)  # the frame and its tokens/s keep both clocks
    assert frame.groupby("micro_batch")["seconds_per_step"].median().to_dict() == \
        pytest.approx({1: 0.012, 4: 0.024})
    assert frame.groupby("micro_batch")["cpu_s"].median().to_dict() == \
        pytest.approx({1: 0.024, 4: 0.012})
    # priced on the clock it compared: one clock per decision
    assert (got.baseline_s, got.chosen_s, got.clock) == (pytest.approx(0.024),
                                                         pytest.approx(0.012), "CPU")
    assert got.naive_ratio == pytest.approx(2.0)
    # the same steps on a GPU: wall seconds are the device's time, and micro-batch 1 is kept
    (gpu,) = decide(frame, MeasuredOn(device="cuda:0"))
    assert (gpu.value, gpu.resolved, gpu.naive_ratio) == (1, True, 1.0)
    assert gpu.why.endswith("; compared on wall seconds")


def test_a_screen_of_one_step_is_topped_up_to_five_samples_a_side(clock):
    step = ClockStep({1: _ms(20), 4: _ms(10)}, clock)
    timed = train_points([step], [(1, 4), (4, 1)], repeats=1, warmup_steps=1)
    timed, spent = retime([step], timed, lambda samples: [], budget_s=0.0)
    assert timed.groupby("micro_batch")["repeat"].apply(list).tolist() == [[0, 1, 2, 3, 4]] * 2
    assert spent == 0.0  # four rounds of both points, the screen's share: no repeats
    (got,) = decide(accum_frame(timed, ROWS * 8), MeasuredOn(device="cpu"))
    assert got.value == 4 and got.resolved and got.samples == (5, 5)


def test_a_load_that_moves_during_the_job_sweep_hits_every_micro_batch(clock):
    # micro-batch 1 and 4 cost the same, and the machine doubles its speed partway (a
    # neighbour leaves): screened a step each, then timed in interleaved rounds, both points see
    # both speeds, and 1 is kept within noise (each point's steps one after another gave 4 a
    # resolved 2x it never had)
    from diag.config import QLoraConfig
    from diag.qlora.measure import JobInputs, accum_on_job

    calls = []

    class Moving(ClockStep):
        def update(self) -> None:
            calls.append(1)
            took = 0.020 if len(calls) <= 7 else 0.010
            self.clock.cpu += took
            self.clock.now += took
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    step = Moving({1: [0.0], 4: [0.0]}, clock)
    job = JobInputs(ROWS, Path("."), Path("."), torch.device("cpu"))
    got = accum_on_job(QLoraConfig.quick(decide_budget_s=0.0), job, [1, 4],
                       on=SimpleNamespace(step=lambda: step))
    (decided,) = got.decisions
    assert (decided.value, decided.resolved) == (1, False), decided.why
    assert decided.samples == (5, 5)


def test_the_steps_own_memory_is_what_autograd_saved_plus_the_model_state():
    step = ClockStep({8: [0.0], 16: [0.0]})
    timed = train_points([step], [(8, 1), (16, 1)], repeats=1, warmup_steps=1)
    peak = timed.set_index("micro_batch")["peak_mem_gb"] * 1e9
    params = sum(p.numel() * 4 for p in step.model.parameters())
    # parameters, gradients and AdamW's two moments at least; each micro-batch row adds the
    # input and the ReLU output saved for backward (WIDTH floats each), nothing of the process
    assert 4 * params < peak[8] < 4 * params + 1024 + 2 * 8 * WIDTH * 4
    assert peak[16] - peak[8] == 2 * 8 * WIDTH * 4
    memory = PeakMemory(torch.device("cpu"))
    with pytest.raises(RuntimeError), memory.watch(step):
        raise RuntimeError("a failed step")
    assert math.isnan(memory.gb())  # no figure from a step that did not finish


def test_checkpointing_on_faster_than_off_is_re_measured_then_never_priced():
    from diag.qlora.checkpointing import decide as ckpt_decide
    from diag.qlora.checkpointing import pending

    # on a CPU the step's CPU seconds decide (cpu_s); its wall seconds say on costs 1.5x
    rows = [{"gradient_checkpointing": on, "micro_batch": m, "cpu_s": s * (1 + 0.01 * r),
             "seconds": (1.5 if on else 1.0) * (1 + 0.01 * r), "peak_mem_gb": 0.1, "repeat": r}
            for r in range(5) for m, (on_s, off_s) in ((1, (1.2, 1.0)), (4, (0.5, 1.0)))
            for on, s in ((True, on_s), (False, off_s))]
    frame = pd.DataFrame(rows)
    samples = {(0 if on else 1, m, 1): list(g["cpu_s"])
               for (on, m), g in frame.groupby(["gradient_checkpointing", "micro_batch"])}
    assert pending(samples) == [(0, 4, 1), (1, 4, 1)]  # micro 1 is settled; 4 is impossible
    (got,) = ckpt_decide(frame, "cpu", memory=(10.0, "x"), naive_micro_batch=1)
    assert got.basis == "default" and got.value is False and got.naive_ratio is None
    assert got.why.startswith("on measured faster than off (resolved (2.00x, 5 + 5 samples")
    assert "no timing prices it" in got.why
    (gpu,) = ckpt_decide(frame, "cuda:0", memory=(10.0, "x"), naive_micro_batch=1)  # on wall
    assert (gpu.value, gpu.resolved) == (False, True)
    assert (gpu.chosen_s, gpu.naive_ratio) == (pytest.approx(1.02), pytest.approx(1.5))
    assert gpu.why.endswith("; compared on wall seconds")
    # alike on and off: off fits, but nothing says it is faster, so the naive plan's on stays
    alike = frame.assign(cpu_s=[1.0 + 0.01 * (i % 10) for i in range(len(frame))])
    (kept,) = ckpt_decide(alike, "cpu", memory=(10.0, "x"), naive_micro_batch=1)
    assert (kept.value, kept.resolved, kept.naive_ratio) == (True, False, 1.0)
    assert "within noise" in kept.why and "(the naive plan's, kept)" in kept.why
    assert kept.saving_s() == 0


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "10", True])
def test_a_bad_decide_budget_is_refused_in_one_line(value):
    from diag.config import QLoraConfig

    with pytest.raises(ValueError) as err:
        QLoraConfig(decide_budget_s=value)
    assert str(err.value) == (f"QLoraConfig.decide_budget_s={value!r}: must be a finite number "
                              "of seconds >= 0")
    assert QLoraConfig(decide_budget_s=0).decide_budget_s == 0
