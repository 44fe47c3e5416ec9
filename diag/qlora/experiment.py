"""Naive vs optimized QLoRA runs on the same records, seed and schedule: where the time went,
every figure read from one cost table (diag.forecast) of costs timed before and in the runs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diag.machine.device import on_cpu_threads

if TYPE_CHECKING:
    import pandas as pd
    from diag.config import QLoraConfig
    from diag.decision import Decision
    from diag.qlora.base import Bases, Sources
    from diag.qlora.job import PlanRun
    from diag.qlora.plans import Plan


ADVICE = ["stage", "finding", "seconds_saved", "evidence"]  # QLoraResult.advice's columns


@dataclass(frozen=True)
class QLoraResult:
    """What `compare` returns (first field: the main table)."""

    frame: pd.DataFrame  # one row per plan: its median round's summary, priced totals, spread
    stages: pd.DataFrame  # StageTimer rows of each plan's median round (`run` = plan)
    losses: pd.DataFrame  # run, step, loss, learning_rate (the median round's)
    shares: pd.DataFrame  # diag.amdahl.shares of the stages, per plan (wall: where time went)
    plans: pd.DataFrame  # run, setting, value, basis, evidence: what ran
    costs: pd.DataFrame  # the cost table (diag.forecast.costs.COLUMNS), before and runs
    savings: pd.DataFrame  # per stage the saving predicted before the runs vs measured
    waterfall: pd.DataFrame  # naive -> each fixed stage -> the residual -> optimized
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence
    rounds: pd.DataFrame  # every plan x round summary, in the order they ran
    comparison: pd.DataFrame | None = None  # one row: the headline's figures (both plans ran)
    mfu: pd.DataFrame | None = None  # per plan: MFU by executed and by model FLOPs
    measured: pd.DataFrame | None = None  # the measurement rows the cost table aggregates


@on_cpu_threads
def run_qlora(cfg: QLoraConfig | None = None, decisions: Iterable[Decision] | None = None,
              budget_s: float | None = None) -> QLoraResult:
    """`diag qlora`: cfg's inputs checked before any work, then `compare`."""
    from diag.config import QLoraConfig
    from diag.preflight import preflight
    from diag.qlora.checkpoints import claim
    from diag.qlora.measure import read_results

    cfg = cfg or QLoraConfig.default()
    if cfg.out_dir:  # another run's checkpoints there: refused unless --resume (same settings)
        claim(cfg.out_dir, cfg.identity(), cfg.resume, folders=("naive", "optimized"))
    if decisions is None and cfg.results:
        decisions = read_results(cfg)
    preflight(cfg, job=cfg)
    return compare(cfg, decisions, budget_s=budget_s)


def compare(cfg: QLoraConfig, decisions: Iterable[Decision] | None = None,
            src: Sources | None = None, budget_s: float | None = None) -> QLoraResult:
    """The plans, their costs timed before the runs, the runs in rounds, their FLOPs, the result."""
    from diag.noise import clock
    from diag.qlora.base import Bases
    from diag.mfu import count_plans
    from diag.qlora.job import open_sources, rank_device

    device = rank_device(cfg)[0]  # under a launcher: joins before the first barrier
    on = clock(device).name
    with contextlib.nullcontext(src) if src else open_sources(cfg) as src:
        plans = [p.for_device(str(device)) for p in _plans(cfg, decisions, src)]  # as they ran
        with Bases() as bases:
            before = _before(cfg, plans, src, bases, device)
            runs = _rounds(cfg, plans, src, bases, on, budget_s)
            counted = count_plans(cfg, plans, src, bases)
    return _result(plans, before, runs, counted, on)


def _plans(cfg: QLoraConfig, decisions: Iterable[Decision] | None, src: Sources) -> list[Plan]:
    """cfg.plan's plans, the optimized one's inputs filled untimed (rank 0 first under DDP)."""
    from diag.qlora.job import prepare
    from diag.qlora.measure import plan_from_job
    from diag.qlora.plans import Plan
    from diag.timing.distributed import root_first

    plans = [Plan.naive()] if cfg.plan in ("naive", "both") else []
    if cfg.plan in ("optimized", "both"):
        plans.append(plan_from_job(cfg, decisions, src))
        with root_first():
            prepare(cfg, plans[-1], src)
    return plans


def _before(cfg: QLoraConfig, plans: list[Plan], src: Sources, bases: Bases, device: Any
            ) -> pd.DataFrame | None:
    """Both plans' starts and own steps timed before the runs (the predictions' rows)."""
    import bitsandbytes  # noqa: F401
    import pandas as pd
    import peft  # noqa: F401
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from diag.noise import clock
    from diag.qlora.starts import time_starts, time_steps
    from diag.qlora.trainer import trainer_class

    # what a start imports or builds once per process, paid here: no one plan's start pays it
    get_checkpoint_conversion_mapping("llama")
    trainer_class()
    if len(plans) < 2:
        return None
    got = pd.concat([time_starts(cfg, plans, src, clock(device).name),
                     time_steps(cfg, plans, src, bases, device)], ignore_index=True)
    gc.collect()  # the measurements' models (reference cycles) go before the first start
    return got


def _rounds(cfg: QLoraConfig, plans: list[Plan], src: Sources, bases: Bases, clock: str,
            budget_s: float | None) -> list[PlanRun]:
    """cfg.rounds interleaved rounds, then up to 16 while the headline is unresolved in budget."""
    from tqdm.auto import tqdm
    from diag.forecast.costs import measured
    from diag.forecast.story import headline, rounds_of
    from diag.noise import MIN_SAMPLES, interleave
    from diag.qlora.job import run_plan

    # a single round is a quick look: never extended
    budget = 0.0 if cfg.rounds == 1 else cfg.decide_budget_s if budget_s is None else budget_s
    bar = tqdm(desc="qlora plans x rounds", unit="run", leave=False)
    by, ran = {p.name: p for p in plans}, []

    def one(name: str, rnd: int) -> PlanRun:
        bar.update()
        ran.append(run_plan(cfg, by[name], src, bases, rnd))
        return ran[-1]

    def pending(got: dict[str, list[PlanRun]]) -> bool:
        if len(plans) < 2 or len(got["naive"]) < MIN_SAMPLES:
            return len(plans) == 2
        rows = measured(r for runs in got.values() for run in runs
                        for r in run.costs.to_dict("records"))
        per = rounds_of(rows, clock)
        totals = {p: sorted(v)[len(v) // 2] for p, v in per.items()}
        tokens = {p: runs[0].summary["real_tokens"] for p, runs in got.items()}
        return not headline(per, tokens, clock, totals)["resolved"]

    with bar:
        interleave(list(by), one, pending, budget_s=budget, min_rounds=cfg.rounds,
                   max_rounds=max(cfg.rounds, 16 if budget else cfg.rounds))
    return ran  # in the order they ran


def _result(plans: list[Plan], before: pd.DataFrame | None, runs: list[PlanRun],
            counted: dict, clock: str) -> QLoraResult:
    """The runs' own tables, then every figure read from the cost table (diag.forecast.story)."""
    import pandas as pd
    from diag.amdahl import shares
    from diag.forecast import story
    from diag.qlora.job import counts
    from diag.mfu import run_mfu
    from diag.qlora.plans import fixes

    every = pd.DataFrame([r.summary for r in runs])
    measured = pd.concat([before, *(r.costs for r in runs)], ignore_index=True)
    kept = [_median_run(runs, p.name) for p in plans]
    frame = pd.DataFrame([k.summary | _spread(every, k.plan) for k in kept])
    stages = pd.concat([k.stages for k in kept], ignore_index=True)
    out = dict(frame=frame, stages=stages, losses=pd.concat([k.losses for k in kept]),
               shares=shares(stages), rounds=every, measured=measured,
               plans=pd.concat([p.frame() for p in plans], ignore_index=True),
               mfu=run_mfu(frame, stages, counted))
    if len(plans) < 2:
        from diag.forecast.costs import table

        empty = pd.DataFrame(columns=ADVICE)
        return QLoraResult(**out, costs=table(measured), savings=empty, waterfall=empty,
                           advice=empty)
    told = story.tell(measured, {k.plan: counts(k.summary) for k in kept}, clock, fixes(*plans),
                      {k.plan: k.summary["real_tokens"] for k in kept}, _steps_met(runs, clock))
    advice = told["savings"].rename(columns={"measured_s": "seconds_saved"})
    return QLoraResult(**out, advice=advice[advice["finding"] != "unchanged"][ADVICE], **told)


def _steps_met(runs: list[PlanRun], clock: str) -> list[float]:
    """The naive steady step on `clock` as each round met it."""
    met = []
    for r in (r for r in runs if r.plan == "naive"):
        rows = r.costs[(r.costs["stage"] == "train") & (r.costs["clock"] == clock)]
        steady = r.summary["steps"] - r.summary["warmup_steps"]
        met += [float(rows["seconds"].iloc[0]) / steady] if len(rows) and steady else []
    return met


def _median_run(runs: list[PlanRun], plan: str) -> PlanRun:
    """The plan's lower-median round by seconds: a round that ran, not a blend of rounds."""
    mine = sorted((r for r in runs if r.plan == plan), key=lambda r: r.summary["seconds"])
    return mine[(len(mine) - 1) // 2]


def _spread(every: pd.DataFrame, plan: str) -> dict[str, float]:
    mine = every[every["plan"] == plan]["seconds"]
    return {"seconds_min": float(mine.min()), "seconds_max": float(mine.max()), "rounds": len(mine)}
