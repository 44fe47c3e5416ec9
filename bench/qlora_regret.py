"""The optimized plan's regret: its step against the best of a grid fixed here, on the same job.

The grid is not derived from the plan or its config's sweep ranges: micro-batch 1, 2, 4, 8, 16
(those the pipeline's rows per step allow), workers 0-4, checkpointing on/off, naive/packed rows.
Every point is timed as the plan is: the job's steps through the real Trainer
(diag.qlora.trainer) on a base loaded once per checkpointing setting; a Step is its steady
steps' CPU seconds (this process and its DataLoader workers) and wall seconds per trained token
(the first step, worker start-up and set-up are not steady). The regret is judged on CPU
seconds: on this shared box a step's wall is mostly the scheduler's share (wall spread 18-33%
over rounds against CPU's 7-20% at load ~5.5, 51-55% against 13-17% at ~6.5); the wall regret
is printed beside it.
Points are screened once (one steady step; `screen`); the best FINALISTS, the plan's own point
(an A/A check: the plan's settings) and the plan then run interleaved rounds
(diag.noise.Rounds) until the grid best's spread is within RESOLUTION or the budget
ends. `python bench/qlora_regret.py` measures the plan on the job, then the grid.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import TrainerCallback

from diag.config import QLoraConfig
from diag.qlora import Plan
from diag import noise
from tqdm.auto import tqdm

GRID = {"micro_batch": (1, 2, 4, 8, 16), "num_workers": (0, 1, 2, 3, 4),
        "gradient_checkpointing": (True, False), "pipeline": ("naive", "packed")}
AXES = tuple(GRID)  # a point's settings: what the plan's own point is matched on
WIDEN = 3  # the best compute settings at workers 0 screened at every other workers value
FINALISTS = 3  # the best screened points that go on to rounds
REPEATS = 6  # a round's sample: the job's steps this many times over (23 steady steps of 4:
#              the grid best's CPU spread 4.7% over 5 rounds at load ~6 here; 11 steps gave
#              6-12%, the job's own 3 gave 14-18%)
RESOLUTION = 0.05  # the grid best's spread over its rounds the regret must be finer than


def grid_plan(micro: int, workers: int, ckpt: bool, pipeline: str) -> Plan:
    """A grid point: the naive plan's every other setting (its fetch and model cache do not
    touch a step), the DataLoader's own knobs for workers (persistent, prefetch 2)."""
    return dataclasses.replace(
        Plan.naive(), name=f"m{micro}-w{workers}-gc{int(ckpt)}-{pipeline}", micro_batch=micro,
        num_workers=workers, gradient_checkpointing=ckpt, pipeline=pipeline,
        persistent_workers=workers > 0, prefetch_factor=2 if workers else None)


class Step(NamedTuple):
    """A plan's steady step on the job, per trained token."""

    cpu: float  # CPU seconds: this process's threads and its DataLoader workers, mean per step
    wall: float  # wall seconds, median per step


class CpuClock(TrainerCallback):
    """A TrainerCallback: at each step's end: the CPU seconds the job has spent so far (this process
    and its DataLoader workers, which start at 0 when forked) and the wall clock, per step."""

    def __init__(self, servers: set[int]) -> None:
        self.servers, self.marks = servers, []  # servers: child processes that are no worker

    def read(self) -> tuple[float, float]:
        import psutil

        workers = [c for c in psutil.Process().children() if c.pid not in self.servers]
        return (time.process_time() + sum(sum(c.cpu_times()[:2]) for c in workers),
                time.perf_counter())

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self.marks = [self.read()]

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.marks.append(self.read())


class StepClock:
    """The job's inputs prepared once, its base loaded once per checkpointing setting; `time`
    runs a plan's steps through the Trainer and gives its steady Step per token."""

    def __init__(self, cfg: QLoraConfig, src: Any) -> None:
        import psutil

        from diag.machine.device import resolve
        from diag.qlora.data import job_records
        from diag.qlora.job import load_model, prepare

        self.cfg, self.device = cfg, resolve(cfg.device)
        base = dataclasses.replace(Plan.naive(), fetch="land", model_cache="persistent",
                                   pipeline="packed")
        self.data_path, self.folder, _ = prepare(cfg, base, src)  # land, cache, token cache
        self.records = job_records(cfg, self.data_path, self.folder)
        # as run_plan loads it: checkpointing is set by prepare_model_for_kbit_training
        self.models = {ckpt: load_model(cfg, dataclasses.replace(base, gradient_checkpointing=ckpt),
                                        self.folder, self.device) for ckpt in (True, False)}
        self.servers = {c.pid for c in psutil.Process().children()}  # the embedded S3 and hub
        self.seconds = 0.0  # wall spent in `time`, set-up and start-up included
        self._data: dict[tuple[str, int], Any] = {}

    def data(self, plan: Plan) -> Any:
        """The plan's Dataset of the job (its rows depend on its pipeline and micro-batch)."""
        from diag.qlora.data import build_dataset

        key = (plan.pipeline, plan.micro_batch)
        if key not in self._data:
            attention = self.models[False].config._attn_implementation
            self._data[key] = build_dataset(self.cfg, plan, self.records, self.folder,
                                            self.data_path, attention)
        return self._data[key]

    def time(self, plan: Plan, steps: int | None = None) -> Step:
        """Plan's steady step per trained token over the job's first `steps` steps (None: all
        cfg.steps; the first cfg.warmup_steps, worker start-up in them, are not steady). No
        checkpoint is saved: that is not a step."""
        from diag.qlora.trainer import end_workers, trainer_for
        from diag.timing import StageTimer

        start = time.perf_counter()
        data = self.data(plan)
        clock = CpuClock(self.servers)
        with tempfile.TemporaryDirectory(prefix="diag-regret-") as out:
            trainer, _ = trainer_for(self.cfg, plan.for_device(str(self.device)),
                                     self.models[plan.gradient_checkpointing], data, Path(out),
                                     self.device, StageTimer(device=self.device),
                                     callbacks=(clock,), save_strategy="no",
                                     max_steps=steps or self.cfg.steps)
            trainer.train()
            end_workers(trainer)
        self.seconds += time.perf_counter() - start
        cpu, wall = zip(*clock.marks[self.cfg.warmup_steps:], strict=True)
        per_token = self.cfg.steps / data.stats["real_tokens"]
        return Step((cpu[-1] - cpu[0]) / (len(cpu) - 1) * per_token,
                    statistics.median(b - a for a, b in itertools.pairwise(wall)) * per_token)


def grid(clock: StepClock) -> list[Plan]:
    """Every point of GRID the job can run: a micro-batch its pipeline's rows per step allow
    (one that the job would cap to a smaller one is that smaller point again)."""
    points = [grid_plan(*values) for values in itertools.product(*GRID.values())]
    return [p for p in points if clock.data(p).micro_batch == p.micro_batch]


def own_point(plan: Plan, points: list[Plan]) -> Plan | None:
    return next((p for p in points if all(getattr(p, a) == getattr(plan, a) for a in AXES)),
                None)


def rounds(clock: StepClock, plans: list[Plan], budget_s: float) -> dict[str, list[Step]]:
    """Interleaved rounds (order alternating) of plans' steps until the CPU seconds of the grid
    best (plans but the last) spread within RESOLUTION, or budget_s is spent (at least
    noise.MIN_SAMPLES rounds)."""
    order, got = itertools.cycle((plans, plans[::-1])), {p.name: [] for p in plans}

    def round_() -> list[float]:
        for p in next(order):
            got[p.name].append(clock.time(p, clock.cfg.steps * REPEATS))
        return [got[p.name][-1].cpu for p in plans]

    def pending(samples: list[list[float]]) -> bool:
        return noise.spread(min(samples[:-1], key=statistics.median)) > RESOLUTION

    noise.Rounds(round_, pending, budget_s=budget_s).run()
    return got


def screen(clock: StepClock, points: list[Plan], plan: Plan) -> dict[str, float]:
    """Each point's CPU seconds per token over one steady step, in two stages: every compute
    setting (micro-batch, checkpointing, pipeline) at workers 0, then the best WIDEN of those at
    every other workers value, and the plan's own point if it is not screened yet. A worker
    moves a step's data work to another process, it does not remove it (its CPU counts), so
    the workers axis is screened where the compute is cheapest (90 points all: 176 s at load
    ~5.5, ~6 min at load 7)."""
    def run(ps: list[Plan], stage: str) -> dict[str, float]:
        return {p.name: clock.time(p, clock.cfg.warmup_steps + 1).cpu for p in tqdm(ps, stage)}

    def compute(p: Plan) -> tuple:
        return p.micro_batch, p.gradient_checkpointing, p.pipeline

    first = [p for p in points if p.num_workers == 0]
    got = run(first, "regret grid, workers 0")
    best = {compute(p) for p in sorted(first, key=lambda p: got[p.name])[:WIDEN]}
    widen = [p for p in points if p.num_workers and compute(p) in best]
    mine = own_point(plan, points)
    if mine and mine.name not in got and mine not in widen:
        widen.append(mine)
    return got | run(widen, "regret grid, workers 1-4")


def regret(cfg: QLoraConfig, optimized: Plan, src: Any, budget_s: float = 120.0) -> dict:
    """The grid screened (`screen`), the best FINALISTS by CPU seconds and the plan over
    rounds: the figures print_regret shows."""
    clock = StepClock(cfg, src)
    points = grid(clock)
    gc.freeze()  # the loaded bases and sources out of each Trainer's gc.collect (~1 s a point)
    try:
        cpu = screen(clock, points, optimized)
        screen_s = clock.seconds
        ranked = sorted((p for p in points if p.name in cpu), key=lambda p: cpu[p.name])
        mine = own_point(optimized, points)
        # the plan's own point, when the grid has it, runs too: the same settings as the plan,
        # so the plan over it is an A/A check of the noise
        finalists = ranked[:FINALISTS] + ([mine] if mine and mine not in ranked[:FINALISTS]
                                          else [])
        got = rounds(clock, [*finalists, optimized], budget_s)
    finally:
        gc.unfreeze()
    return {"points": len(points), "screened": len(cpu), "screen_s": screen_s,
            "seconds": clock.seconds, "mine": mine and (mine.name, ranked.index(mine) + 1),
            "plan": got.pop(optimized.name), "got": got}


def _figures(best: list[Step], plan: list[Step], clock: str) -> str:
    a, b = [getattr(s, clock) for s in best], [getattr(s, clock) for s in plan]
    paired = [y / x for x, y in zip(a, b, strict=True)]
    return (f"{statistics.median(b) / statistics.median(a):.3g} ({clock}: "
            f"{noise.compare(a, b).describe()}; per-round ratio spread {noise.spread(paired):.1%})")


def print_regret(cfg: QLoraConfig, optimized: Plan, src: Any, budget_s: float = 120.0) -> None:
    r = regret(cfg, optimized, src, budget_s)
    got, plan = r["got"], r["plan"]
    cpu = {n: statistics.median(s.cpu for s in v) for n, v in got.items()}
    best = min(cpu, key=cpu.get)
    axes = " x ".join(f"{k} {v}" for k, v in GRID.items())
    print(f"regret grid: {r['points']} points ({axes}; the micro-batches each pipeline's rows "
          f"per step allow), {r['screened']} screened once (every compute setting at workers "
          f"0, the best {WIDEN} at workers 1-4) in {r['screen_s']:.3g} s; the best {FINALISTS} "
          f"(and the plan's own point) and the plan over {len(plan)} interleaved rounds, CPU "
          "ms per trained token of a steady step: "
          + ", ".join(f"{n} {cpu[n] * 1e3:.3g} (spread {noise.spread([s.cpu for s in got[n]]):.1%})"
                      for n in sorted(cpu, key=cpu.get))
          + f"; the plan {statistics.median(s.cpu for s in plan) * 1e3:.3g}")
    settings = ", ".join(f"{a} {getattr(optimized, a)}" for a in AXES)
    if r["mine"] is None:
        print(f"the plan's point ({settings}) is not in the grid")
    else:
        name, rank = r["mine"]
        line = (f"the plan's point ({settings}) is in the grid: {name}, screened #{rank} of "
                f"{r['screened']}; the plan over it (A/A, the same settings): "
                + _figures(got[name], plan, "cpu"))
        if name == best:  # then the regret is the plan over itself: show the next point too
            other = min((n for n in cpu if n != name), key=cpu.get)
            line += f"; the plan over the best other point {other}: "
            line += _figures(got[other], plan, "cpu")
        print(line)
    print(f"qlora_regret_wall: {_figures(got[best], plan, 'wall')}")
    print(f"qlora_regret: {_figures(got[best], plan, 'cpu')} over the grid best {best}; "
          f"resolution {noise.spread([s.cpu for s in got[best]]):.3f} (its spread over "
          f"{len(plan)} rounds); job of {cfg.records} records, {cfg.steps} steps, seq_len "
          f"{cfg.seq_len}; grid {r['seconds']:.3g} s) (goal <= 1.05, resolution <= {RESOLUTION})")


def main() -> None:
    import argparse

    from diag.qlora.job import open_sources
    from diag.qlora.measure import plan_from_job

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="seconds the finalists' rounds may take")
    args = parser.parse_args()
    cfg = QLoraConfig(records=args.records, steps=args.steps, seq_len=args.seq_len, lora_r=8,
                      lora_alpha=16, warmup_steps=1)
    start = time.perf_counter()
    with open_sources(cfg) as src:
        optimized = plan_from_job(cfg, src=src)
        print(f"the plan, measured on the job in {time.perf_counter() - start:.3g} s: "
              + ", ".join(f"{s} {getattr(optimized, s)}" for s in AXES))
        print_regret(cfg, optimized, src, args.budget_s)
    print(f"bench wall: {time.perf_counter() - start:.3g} s; load average "
          + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1 / 5 / 15 min)")


if __name__ == "__main__":
    from diag.machine.device import cpu_threads

    with cpu_threads():  # as every diag run_*: on a CPU, DIAG_CPU_THREADS (default 1)
        main()
