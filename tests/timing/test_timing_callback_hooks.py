"""TimingCallback driven hook by hook, as a Trainer calls it, on a scripted clock (no Trainer, no
model, no sleeps): each stage's seconds and step exactly, warm-up, resume, evaluations and
checkpoints kept out of `train`, the DDP comm_wait split, the CUDA sync at each boundary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
from transformers import TrainerControl, TrainerState  # noqa: E402

from diag.timing import callback as module  # noqa: E402
from diag.timing.callback import TimingCallback  # noqa: E402
from diag.timing import StageTimer  # noqa: E402

ARGS = SimpleNamespace(device="cpu")


class Clock:
    """time.perf_counter for the callback: returns `now`, which the test moves."""

    def __init__(self, now: float = 0.0) -> None:
        self.now, self.reads = now, 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.now

    def process_time(self) -> float:  # the CPU clock (read apart, not counted in `reads`)
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(module, "time", c)
    return c


class Run:
    """The Trainer's side: its state, control and the order it calls the hooks in."""

    def __init__(self, cb: TimingCallback, clock: Clock, global_step: int = 0) -> None:
        self.cb, self.clock = cb, clock
        self.state, self.control = TrainerState(global_step=global_step), TrainerControl()

    def at(self, t: float) -> Run:
        self.clock.now = t
        return self

    def call(self, hook: str, **kw) -> None:
        getattr(self.cb, hook)(ARGS, self.state, self.control, **kw)

    def step(self, begin: float, end: float) -> None:
        self.at(begin).call("on_step_begin")
        self.state.global_step += 1  # the Trainer counts the step before on_step_end
        self.at(end).call("on_step_end")


class Comm:
    """timer.comm under DDP: the all-reduce wait backward left exposed since the last take()."""

    def __init__(self, waits):
        self.waits, self.taken = list(waits), 0

    def take(self) -> float:
        self.taken += 1
        return self.waits.pop(0)


def rows(cb: TimingCallback) -> list[tuple]:
    return list(cb.timer._rows)


def test_each_stage_gets_its_seconds_and_step(clock):
    cb = TimingCallback(warmup_steps=1)
    cb.setup_from = 1.0
    run = Run(cb, clock)
    run.at(3.0).call("on_train_begin")
    assert cb.setup_from is None
    run.step(4.0, 6.0)  # step 0: warm-up, its wait (the loader's start-up) included
    run.at(6.5).call("on_log", logs={"loss": 1.0})  # logging: the next wait starts after it
    run.step(7.0, 9.0)
    run.at(9.5).call("on_log", logs={"eval_loss": 1.0})  # an evaluation's log: mark stays
    run.at(10.0).call("on_evaluate")
    run.at(10.5).call("on_save")
    run.step(11.0, 12.0)
    run.at(20.0).call("on_train_end")
    assert rows(cb) == [("setup", 2.0, None), ("warmup", 3.0, None), ("data_wait", 0.5, 1),
                        ("compute", 2.0, 1), ("eval", 1.0, None), ("checkpoint", 0.5, None),
                        ("data_wait", 0.5, 2), ("compute", 1.0, 2),
                        ("train", 12.0 - 6.0 - 1.5, None)]
    assert cb.steps == 3
    frame = cb.frame()
    assert list(frame["stage"]) == [r[0] for r in rows(cb)]
    assert frame["step"].isna().sum() == 5


def test_without_warm_up_every_step_is_timed_from_train_begin(clock):
    cb = TimingCallback(warmup_steps=0, timer=StageTimer())
    run = Run(cb, clock)
    run.at(1.0).call("on_train_begin")
    run.step(1.25, 2.0)
    run.step(2.5, 3.0)
    run.at(3.5).call("on_log")  # logs=None: a log like any other
    run.at(4.0).call("on_train_end")
    assert rows(cb) == [("data_wait", 0.25, 0), ("compute", 0.75, 0), ("data_wait", 0.5, 1),
                        ("compute", 0.5, 1), ("train", 2.5, None)]


def test_a_resumed_run_warms_up_again_from_where_it_resumed(clock):
    cb = TimingCallback(warmup_steps=2)
    # taken at each step's begin (the warm-up steps' waits: dropped) and at a timed step's end
    cb.timer.comm = Comm([7.0, 8.0, 9.0, 0.25])
    run = Run(cb, clock, global_step=5)
    run.at(0.0).call("on_train_begin")
    run.step(1.0, 2.0)  # step 5
    run.at(2.5).call("on_save")  # during warm-up: recorded, not taken out of train
    run.step(3.0, 4.0)  # step 6: the last warm-up step, steady from its end
    run.step(4.5, 5.0)  # step 7
    run.at(9.0).call("on_train_end")
    assert rows(cb) == [("warmup", 2.0, None), ("checkpoint", 0.5, None), ("warmup", 1.5, None),
                        ("data_wait", 0.5, 7), ("comm_wait", 0.25, 7), ("compute", 0.25, 7),
                        ("train", 1.0, None)]


def test_only_warm_up_steps_leave_no_train_row(clock):
    cb = TimingCallback(warmup_steps=3)
    run = Run(cb, clock)
    run.at(0.0).call("on_train_begin")
    run.step(1.0, 2.0)
    run.step(2.0, 4.0)
    run.at(5.0).call("on_train_end")
    assert rows(cb) == [("warmup", 2.0, None), ("warmup", 2.0, None)]


def test_a_side_stage_before_training_only_sets_the_mark(clock):
    cb = TimingCallback(warmup_steps=0)
    run = Run(cb, clock)
    run.at(1.0).call("on_evaluate")  # no mark yet: nothing to bill it from
    assert rows(cb) == []
    run.at(2.0).call("on_step_begin")  # a step before on_train_begin waits from the eval
    assert cb._wait == 1.0
    cb2 = TimingCallback()
    run2 = Run(cb2, clock)
    run2.at(3.0).call("on_step_begin")  # no mark at all: no wait
    assert cb2._wait == 0.0 and cb2._begin == 3.0


def test_train_is_never_negative_and_ends_at_the_last_mark(clock):
    cb = TimingCallback(warmup_steps=0)
    run = Run(cb, clock)
    run.at(10.0).call("on_train_begin")
    cb._side = 5.0  # more side time than the loop took: clamped, not negative
    run.at(11.0).call("on_train_end")
    assert rows(cb) == [("train", 0.0, None)]
    late = TimingCallback(warmup_steps=0)
    late.setup_from = 50.0  # set after the clock it is compared with: no negative setup
    run = Run(late, clock)
    run.at(10.0).call("on_train_begin")
    late._mark = None
    run.at(10.75).call("on_train_end")  # no mark: now
    assert rows(late) == [("setup", 0.0, None), ("train", 0.75, None)]


def test_a_second_train_call_resets_setup_and_the_side_seconds(clock):
    cb = TimingCallback(warmup_steps=0)
    cb.setup_from = 0.0
    run = Run(cb, clock)
    run.at(1.0).call("on_train_begin")
    run.at(2.0).call("on_save")
    run.at(3.0).call("on_train_begin")  # setup_from was used up; side seconds start again
    run.at(4.0).call("on_save")
    run.step(4.5, 5.5)
    run.at(6.0).call("on_train_end")
    assert rows(cb) == [("setup", 1.0, None), ("checkpoint", 1.0, None),
                        ("checkpoint", 1.0, None), ("data_wait", 0.5, 0), ("compute", 1.0, 0),
                        ("train", 5.5 - 3.0 - 1.0, None)]


class DdpTrainer:
    """The Trainer's side of a DDP step: get_batch_samples fetches the step's batches (fetch_s
    each), then gathers every rank's token count (gather_s: waiting on the slowest loader)."""

    model_wrapped = "ddp"

    def __init__(self, clock: Clock) -> None:
        self.clock, self.fetch_s, self.gather_s = clock, 0.0, 0.0

    def batches(self):
        while True:
            self.clock.now += self.fetch_s
            yield {"input_ids": None}

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        samples = [next(epoch_iterator) for _ in range(num_batches)]
        self.clock.now += self.gather_s
        return samples, None


def test_under_ddp_the_count_gather_broadcast_and_all_reduce_are_comm_wait(clock, monkeypatch):
    import diag.timing.callback

    monkeypatch.setattr(diag.timing.callback, "find_ddp", lambda *candidates: "ddp")
    cb = TimingCallback(warmup_steps=1)
    # the waits inside each step (broadcast + exposed all-reduce), taken at its end; those taken
    # at a step's begin (an eval's forward, a warm-up step's) are dropped
    comm = Comm([9.0, 9.0, 0.25, 9.0, 7.0])
    monkeypatch.setattr(cb.timer, "watch_comm", lambda ddp: setattr(cb.timer, "comm", comm))
    trainer = cb.trainer = DdpTrainer(clock)
    batches = trainer.batches()
    run = Run(cb, clock)
    run.at(0.0).call("on_train_begin")

    def step(fetch: float, gather: float, compute: float) -> None:
        trainer.fetch_s, trainer.gather_s = fetch, gather
        trainer.get_batch_samples(batches, 2, "cpu")  # the Trainer's call, through the callback
        run.call("on_step_begin")
        run.state.global_step += 1
        run.at(clock.now + compute).call("on_step_end")

    step(0.5, 3.0, 1.0)  # warm-up: its waits stay in warmup
    step(0.25, 2.0, 1.0)  # this rank fetched in 0.5 s, then waited 2 s for the slow loader
    step(0.25, 0.0, 1.0)  # more wait inside than the step: capped at the step
    assert comm.taken == 5
    assert rows(cb) == [("warmup", 5.0, None), ("data_wait", 0.5, 1), ("comm_wait", 2.25, 1),
                        ("compute", 0.75, 1), ("data_wait", 0.5, 2), ("comm_wait", 1.0, 2),
                        ("compute", 0.0, 2)]


def test_the_comm_hook_is_put_on_the_trainers_ddp_model_once(clock, monkeypatch):
    import diag.timing.callback

    ddp, seen, watched = object(), [], []

    def find(*candidates):
        seen.append(candidates)
        return ddp

    monkeypatch.setattr(diag.timing.callback, "find_ddp", find)
    cb = TimingCallback()
    monkeypatch.setattr(cb.timer, "watch_comm", watched.append)
    cb.trainer = SimpleNamespace(model_wrapped="wrapped")
    Run(cb, clock).call("on_train_begin", model="model")
    assert seen == [("wrapped", "model")] and watched == [ddp]
    cb.timer.comm = Comm([])
    Run(cb, clock).call("on_train_begin")
    assert seen[1] == ("wrapped", None) and watched == [ddp]  # already watched
    monkeypatch.setattr(diag.timing.callback, "find_ddp", lambda *c: None)
    other = TimingCallback()
    monkeypatch.setattr(other.timer, "watch_comm", watched.append)
    Run(other, clock).call("on_train_begin")
    assert watched == [ddp]


def test_on_cuda_each_boundary_is_a_sync_point(clock, monkeypatch):
    from diag.machine import device as devices

    synced = []
    monkeypatch.setattr(devices, "sync", synced.append)
    cb = TimingCallback(device="cuda:0")
    run = Run(cb, clock)
    run.call("on_train_begin")
    run.step(1.0, 2.0)
    assert synced == ["cuda:0"] * 3 and clock.reads == 3
    from_args = TimingCallback()
    from_args.on_train_begin(SimpleNamespace(device="cuda"), TrainerState(), TrainerControl())
    assert synced[-1] == "cuda"
    cpu = TimingCallback()
    Run(cpu, clock).call("on_train_begin")
    no_device = TimingCallback()
    no_device.on_train_begin(SimpleNamespace(), TrainerState(), TrainerControl())
    assert len(synced) == 4 and cpu._sync is None and no_device._sync is None


def test_a_step_survives_a_kill_the_rows_are_flushed_per_step(clock, tmp_path):
    cb = TimingCallback(warmup_steps=0)
    cb.timer.spill_to(tmp_path / "t.partial.csv")
    run = Run(cb, clock)
    run.call("on_train_begin")
    run.step(1.0, 2.0)
    lines = (tmp_path / "t.partial.csv").read_text().splitlines()
    assert [line.split(",")[:3] for line in lines[1:]] == [["data_wait", "1.0", "0"],
                                                          ["compute", "1.0", "0"]]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_warmup_steps_must_be_a_whole_number(bad):
    with pytest.raises(ValueError, match=rf"warmup_steps={bad!r}: must be a whole number >= 0"):
        TimingCallback(warmup_steps=bad)


def test_defaults_and_a_timer_of_your_own():
    timer = StageTimer()
    cb = TimingCallback(timer, device="cpu")
    assert cb.timer is timer and cb.device == "cpu" and cb.warmup_steps == 1
    fresh = TimingCallback()
    assert isinstance(fresh.timer, StageTimer) and fresh.timer is not timer
    assert (fresh.steps, fresh.setup_from, fresh.trainer, fresh._mark) == (0, None, None, None)
    assert TimingCallback(warmup_steps=0).warmup_steps == 0
