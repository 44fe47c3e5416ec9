"""Several plans' real Trainers stepping in turn, one step each, so a slow change in this shared
box's speed hits them alike.

On this box a step's CPU seconds drift 1.5x over seconds (other tenants: 61-68 ms steps for
a run of seconds, then 100-120 ms, for the same step of the same plan); a plan timed after
another as a whole run (4-5 s) meets another regime, which no number of such rounds pairs
away (two runs of one plan adjacent in a round: 0.85-1.04 of each other at load 5-10). Here
each plan's `trainer.train()` runs in its own thread, and a callback at its step's end hands
the turn back: `run()` lets each plan run one step (its batch fetch, forward, backward and
optimizer step) while the others wait, so plans are ~0.1 s apart, not seconds. A step's CPU
seconds are the process's during its turn (the others wait on a lock) plus its DataLoader
workers' (forked in its own turns; they prefetch during the others' too). The threads share
glibc's main malloc arena where the process called `one_arena()` first: each on its own, where
a Trainer's tensors landed made it up to 23% faster or slower than its twin for its whole life.
"""

from __future__ import annotations

import ctypes
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback


class Lockstep:
    """`plans`' Trainers on `clock`'s bases and data (a bench StepClock), each in a thread, made
    in that order; `run(warmup, steps)` steps them in turn; `marks[name]`: each step's (CPU and
    wall seconds of its turn, its workers' CPU seconds so far). Leaving the with-block stops
    every Trainer (its training ends, its workers shut down)."""

    def __init__(self, clock: Any, plans: list[Any]) -> None:
        import psutil
        import torch

        self.clock, self.threads_n = clock, torch.get_num_threads()
        self.cond = threading.Condition()
        self.turn: str | None = None  # whose step runs now (None: the caller's)
        self.stopping: set[str] = set()
        self.error: BaseException | None = None
        self.marks: dict[str, list[tuple[float, float, float]]] = {p.name: [] for p in plans}
        self.owner: dict[int, str] = {}  # a DataLoader worker's pid: the plan it was forked for
        self.reaped: dict[str, float] = {}  # CPU seconds of its workers that ended (and were
        #                                     waited for) in its turns
        self.known = {c.pid for c in psutil.Process().children()}  # the embedded servers
        self.tmp = tempfile.TemporaryDirectory(prefix="diag-lockstep-")
        self.threads: dict[str, threading.Thread] = {}
        try:
            for plan in plans:  # one at a time up to its first turn's end (set-up, train begin)
                self.threads[plan.name] = threading.Thread(target=self._train, args=(plan,),
                                                           daemon=True)
                self._run(plan.name, self.threads[plan.name].start)
        except BaseException:
            self.__exit__()  # those already made stop: none waits for ever
            raise

    def _train(self, plan: Any) -> None:
        import torch

        from diag.qlora.trainer import end_workers, trainer_for
        from diag.timing import StageTimer

        clock = self.clock
        try:
            torch.set_num_threads(self.threads_n)  # a new thread's OpenMP count is its own
            trainer, _ = trainer_for(clock.cfg, plan.for_device(str(clock.device)),
                                     clock.models[plan.gradient_checkpointing], clock.data(plan),
                                     Path(self.tmp.name) / plan.name, clock.device,
                                     StageTimer(device=clock.device),
                                     callbacks=(_Turns(self, plan.name),), save_strategy="no",
                                     max_steps=10**6)  # stopped on leaving the with-block
            trainer.train()
            end_workers(trainer)
        except BaseException as e:  # noqa: BLE001  # raised again in the caller's thread
            self.error = e
        finally:
            with self.cond:
                self.turn = None
                self.cond.notify_all()

    def _run(self, name: str, go: Any = None, check: bool = True) -> None:
        """Let `name` run until its next turn's end (go: what starts it); check: raise a
        Trainer's failure here."""
        with self.cond:
            self.turn = name
            self.cond.notify_all()
        if go:
            go()
        with self.cond:
            self.cond.wait_for(lambda: self.turn is None)
        if check and self.error is not None:
            raise RuntimeError(f"{name}'s Trainer failed: {self.error!r}") from self.error

    def run(self, warmup: int, steps: int) -> dict[str, tuple[float, float]]:
        """Every plan's `warmup` steps then `steps` more, one step each in turn, always in the
        order they were made (a cycle: each runs after another; reversed every step, the two
        at the ends ran twice in a row, warm from their own turn: the plan at an end ran 0.97
        of its twin in the middle, 95% interval 0.915-0.987, load ~4); each plan's CPU and
        wall seconds over the `steps`."""
        for _ in range(warmup + steps):
            for name in self.marks:
                self._run(name)
        out = {}
        for name, marks in self.marks.items():
            cpu, wall, workers = zip(*marks[warmup:], strict=True)
            forked = marks[warmup - 1][2] if warmup else 0.0  # its workers' CPU before
            out[name] = (sum(cpu) + workers[-1] - forked, sum(wall))
        return out

    def yield_turn(self, name: str, start: tuple[float, float, float] | None) -> bool:
        """In `name`'s thread at its step's end (start: its turn's clocks, None at train begin):
        its step's marks, then wait for its next turn; True: stop training."""
        if start is not None:
            import psutil

            cpu, wall = time.process_time() - start[0], time.perf_counter() - start[1]
            self.reaped[name] = self.reaped.get(name, 0.0) + _reaped() - start[2]
            for c in psutil.Process().children():
                if c.pid not in self.known:  # forked in this turn: this plan's worker
                    self.known.add(c.pid)
                    self.owner[c.pid] = name
            self.marks[name].append((cpu, wall, self.worker_cpu(name)))
        with self.cond:
            self.turn = None
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == name)
        return name in self.stopping

    def worker_cpu(self, name: str) -> float:
        """The CPU seconds `name`'s live DataLoader workers have spent since they were forked."""
        import psutil

        total = self.reaped.get(name, 0.0)  # non-persistent workers end in their plan's turns
        for pid, owner in self.owner.items():
            if owner == name:
                try:
                    total += sum(psutil.Process(pid).cpu_times()[:2])
                except psutil.NoSuchProcess:
                    pass
        return total

    def __enter__(self) -> Lockstep:
        return self

    def __exit__(self, *exc: object) -> None:
        for name, thread in self.threads.items():
            if thread.is_alive():
                self.stopping.add(name)
                self._run(name, check=False)
                thread.join()
        self.tmp.cleanup()


def one_arena() -> None:
    """Threads made from now on share glibc's main malloc arena (M_ARENA_MAX 1): call it first
    thing in a process, since glibc fixes how many arenas there may be when the first thread
    needs one. On its own arena a thread's Trainer ran 0.77-1.07 of its twin's speed (the same
    settings, 32 steps in lockstep, six pairs made anew, load ~4.5, twice); on one arena 0.98-1.02
    (MALLOC_ARENA_MAX=1) and 0.98-1.09 (this call). A single-threaded step is unaffected: the
    main thread has the main arena anyway."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc's; absent elsewhere
    if mallopt:
        mallopt(-8, 1)  # -8: M_ARENA_MAX in malloc.h


def _reaped() -> float:
    """CPU seconds of this process's children that ended and were waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Turns(TrainerCallback):
    """A Trainer's side of Lockstep: each step's end hands the turn back and waits for the
    next; the turn's clocks start when it comes back."""

    def __init__(self, lock: Lockstep, name: str) -> None:
        self.lock, self.name, self.start = lock, name, None

    def _turn(self, control: Any) -> Any:
        if self.lock.yield_turn(self.name, self.start):
            control.should_training_stop = True
        self.start = (time.process_time(), time.perf_counter(), _reaped())
        return control

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._turn(control)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._turn(control)
