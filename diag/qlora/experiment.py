"""Naive vs optimized QLoRA runs on the same records, seed and schedule: each plan's start and own
step timed before the runs, the runs in interleaved rounds, every figure read from one cost
table (diag.forecast) of those costs; the whole job projected at the costs the runs measured
(`project_job`: what `diag train` would take on every record of the source)."""

from __future__ import annotations

import contextlib
import gc
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from diag.amdahl import shares
from diag.config import QLoraConfig
from diag.data import count_records, read_meta, shard_files
from diag.decision import ADVICE, Decision
from diag.files import scratch_folder
from diag.forecast import story
from diag.forecast.costs import measured, price, row, table
from diag.forecast.eta import job_counts, run_counts, runs_costs
from diag.machine.device import on_cpu_threads
from diag.mfu import count_plans, run_mfu
from diag.noise import MIN_SAMPLES, clock, interleave, unsettled
from diag.preflight import preflight
from diag.qlora import job
from diag.qlora.base import Bases, Sources, timed_folder
from diag.qlora.checkpoints import claim
from diag.qlora.data import build_dataset, counted, job_records
from diag.qlora.measure import JobInputs, QLoraStep, job_inputs, plan_from_job, read_results
from diag.qlora.plans import Plan, fixes
from diag.qlora.trainer import trainer_class
from diag.timing import StageTimer
from diag.timing.distributed import root_first

if TYPE_CHECKING:
    from diag.config import TrainConfig
    from diag.qlora.job import PlanRun

STARTS = {"fetch": "fetch_data", "model_cache": "download", "pipeline": "preprocess"}


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
    cfg = cfg or QLoraConfig.default()
    preflight(cfg, job=cfg)  # before the run file: a refused run writes nothing
    if cfg.out_dir:  # another run's checkpoints there: refused unless --resume (same settings)
        claim(cfg.out_dir, cfg.identity(), cfg.resume, folders=("naive", "optimized"))
    if decisions is None and cfg.results:
        decisions = read_results(cfg)
    return compare(cfg, decisions, budget_s=budget_s)


def compare(cfg: QLoraConfig, decisions: Iterable[Decision] | None = None,
            src: Sources | None = None, budget_s: float | None = None) -> QLoraResult:
    """The plans, their costs timed before the runs, the runs in rounds, their FLOPs, the result."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    device = job.rank_device(cfg)[0]  # under a launcher: joins before the first barrier
    on = clock(device).name
    with contextlib.nullcontext(src) if src else job.open_sources(cfg) as src:
        plans = [Plan.naive()] if cfg.plan in ("naive", "both") else []
        if cfg.plan in ("optimized", "both"):
            plans.append(plan_from_job(cfg, decisions, src))
            with root_first():  # its inputs filled untimed, rank 0 first under DDP
                job.prepare(cfg, plans[-1], src)
        plans = [p.for_device(str(device)) for p in plans]  # as they ran
        changes = fixes(*plans) if len(plans) == 2 else {}
        # what a start imports or builds once per process, paid here: no one plan's start pays it
        get_checkpoint_conversion_mapping("llama")
        trainer_class()
        with Bases() as bases:  # both plans' starts and own steps timed before the runs
            before = pd.concat([time_starts(cfg, plans, src, on),
                                time_steps(cfg, plans, src, bases, device)],
                               ignore_index=True) if len(plans) == 2 else None
            gc.collect()  # the measurements' models (reference cycles) go before the first start
            runs = _rounds(cfg, plans, src, bases, on, budget_s)
            counted = count_plans(cfg, plans, src, bases, device)  # this rank's
    every = pd.DataFrame([r.summary for r in runs])
    kept = [sorted((r for r in runs if r.plan == p.name), key=lambda r: r.summary["seconds"])
            for p in plans]
    kept = [mine[(len(mine) - 1) // 2] for mine in kept]  # lower median: a round that ran
    spread = every.groupby("plan")["seconds"].agg(seconds_min="min", seconds_max="max",
                                                  rounds="size")
    frame = pd.DataFrame([k.summary for k in kept]).join(spread, on="plan")
    stages = pd.concat([k.stages for k in kept], ignore_index=True)
    rows = pd.concat([before, *(r.costs for r in runs)], ignore_index=True)
    out = dict(frame=frame, stages=stages, losses=pd.concat([k.losses for k in kept]),
               shares=shares(stages), rounds=every, measured=rows,
               plans=pd.concat([p.frame() for p in plans], ignore_index=True),
               mfu=run_mfu(frame, stages, counted))
    if len(plans) < 2:
        empty = pd.DataFrame(columns=ADVICE)
        return QLoraResult(**out, costs=table(rows), savings=empty, waterfall=empty, advice=empty)
    met = []  # the naive steady step on `on` as each round met it
    for r in (r for r in runs if r.plan == "naive"):
        train = r.costs[(r.costs["stage"] == "train") & (r.costs["clock"] == on)]
        steady = r.summary["steps"] - r.summary["warmup_steps"]
        met += [float(train["seconds"].iloc[0]) / steady] if len(train) and steady else []
    told = story.tell(rows, {k.plan: run_counts(k.summary) for k in kept}, on, changes,
                      {k.plan: k.summary["real_tokens"] for k in kept}, met)
    advice = told["savings"].rename(columns={"measured_s": "seconds_saved"})
    return QLoraResult(**out, advice=advice[advice["finding"] != "unchanged"][ADVICE], **told)


def time_starts(cfg: QLoraConfig, plans: list[Plan], src: Sources, clock: str) -> pd.DataFrame:
    """Each plan's start, min(cfg.rounds, 3) times; the model folder in the first round alone."""
    # start settings the optimized plan's decisions price on this clock (diag run's): not re-timed
    priced = [d for d in plans[1].decisions if d.per == "start" and d.saving_s() is not None
              and (d.clock or "wall") == clock]
    known = {d.setting for d in priced}

    def start(plan: Plan, rnd: int) -> list[dict[str, Any]]:
        work = scratch_folder(f"diag-qlora-time-{plan.name}")
        try:
            t, c = time.perf_counter(), time.process_time()
            path = job.fetch_data(plans[1] if "fetch" in known else plan, src, work,
                                  cfg.records)[0]
            spent = {"fetch_data": (time.perf_counter() - t, time.process_time() - c)}
            again = "model_cache" in known or rnd > 0  # later rounds: the kept cache
            folder, took = timed_folder(plans[1] if again else plan, src, work)
            if not again:
                spent["download"] = (took["wall"], took["CPU"])
            recs = job_records(cfg, path, folder)  # the run's untimed check_records
            t, c = time.perf_counter(), time.process_time()
            build_dataset(cfg, plan, recs, folder, path)
            spent["preprocess"] = (time.perf_counter() - t, time.process_time() - c)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        said = f"a {plan.name} start timed before the runs"
        return [row(plan.name, stage, "start", s, clock=k, when="before", rnd=rnd, evidence=said)
                for stage, pair in spent.items() if stage not in {STARTS[k] for k in known}
                for k, s in zip(("wall", "CPU"), pair)]

    n = max(1, min(cfg.rounds, 3))
    got, _ = interleave(range(len(plans)), lambda i, rnd: start(plans[i], rnd), min_rounds=n,
                        max_rounds=n)
    rows = [r for runs in got.values() for rs in runs for r in rs]
    rows += [row(p, STARTS[d.setting], "start", s, clock=clock, when="before",  # its two sides
                 evidence=f"the {d.source} decision's: {d.why}")
             for d in priced for p, s in (("naive", d.baseline_s), ("optimized", d.chosen_s))]
    return measured(rows)


def time_steps(cfg: QLoraConfig, plans: list[Plan], src: Sources, bases: Bases,
               device: Any) -> pd.DataFrame:
    """Each plan's own step (plans as run) on the base its rounds reuse, in half decide_budget_s."""
    from diag.accum import retime, train_points

    inputs = job_inputs(cfg, src)  # the landed data and the cached model: hits by now
    steps, frames = [], []
    try:
        for plan in plans:
            data = build_dataset(cfg, plan, job_records(cfg, inputs.data_path, inputs.model_dir),
                                 inputs.model_dir, inputs.data_path)
            n = data.micro_batch * data.grad_accum
            folder, model, _ = bases.load(cfg, plan, src, device, StageTimer(trace=False))
            steps.append(QLoraStep(cfg, folder, device, plan.gradient_checkpointing, model,
                                   rows=[data.dataset[i] for i in range(n)]))
            frames.append(train_points([steps[-1]], [(data.micro_batch, data.grad_accum)],
                                       repeats=1, warmup_steps=1,
                                       desc=f"the {plan.name} step").assign(step=len(frames)))
        timed, _ = retime(steps, pd.concat(frames, ignore_index=True), unsettled,
                          budget_s=cfg.decide_budget_s / 2, at_least=cfg.sweep_steps)
    finally:
        bases.release()  # their adapters off: round 0 starts from a fresh one on each base
    ok = timed[timed["status"] == "ok"]
    rows = []
    for i, plan in enumerate(plans):
        mine = ok[ok["step"] == i]
        said = (f"its own step (micro-batch {int(mine['micro_batch'].iloc[0])} x "
                f"{int(mine['grad_accum'].iloc[0])}) timed {len(mine)}x before the runs, "
                "interleaved with the other plan's") if len(mine) else ""
        for n, pair in enumerate(zip(mine["seconds_per_step"], mine["cpu_s"])):
            rows += [row(plan.name, stage, unit, s, clock=k, when="before", rnd=n, evidence=said)
                     for stage, unit in (("train", "step"), ("warmup", "warmup_step"))
                     for k, s in zip(("wall", "CPU"), pair)]
    return measured(rows)


def _rounds(cfg: QLoraConfig, plans: list[Plan], src: Sources, bases: Bases, clock: str,
            budget_s: float | None) -> list[PlanRun]:
    """cfg.rounds interleaved rounds, then up to 16 while the headline is unresolved in budget."""
    from tqdm.auto import tqdm

    # a single round is a quick look: never extended
    budget = 0.0 if cfg.rounds == 1 else cfg.decide_budget_s if budget_s is None else budget_s
    bar = tqdm(desc="qlora plans x rounds", unit="run", leave=False)
    by, ran = {p.name: p for p in plans}, []

    def one(name: str, rnd: int) -> PlanRun:
        bar.update()
        ran.append(job.run_plan(cfg, by[name], src, bases, rnd))
        return ran[-1]

    def pending(got: dict[str, list[PlanRun]]) -> bool:
        if len(plans) < 2 or len(got["naive"]) < MIN_SAMPLES:
            return len(plans) == 2
        rows = pd.concat([run.costs for runs in got.values() for run in runs], ignore_index=True)
        per = story.rounds_of(rows, clock)
        totals = {p: sorted(v)[len(v) // 2] for p, v in per.items()}
        tokens = {p: runs[0].summary["real_tokens"] for p, runs in got.items()}
        return not story.headline(per, tokens, clock, totals)["resolved"]

    with bar:
        interleave(list(by), one, pending, budget_s=budget, min_rounds=cfg.rounds,
                   max_rounds=max(cfg.rounds, 16 if budget else cfg.rounds))
    return ran  # in the order they ran


@dataclass(frozen=True)
class Projection:
    """The whole job per plan (first field: the main table) and the costs it priced."""

    frame: pd.DataFrame  # plan, stage, seconds, low, high, evidence; per plan `total` first
    costs: pd.DataFrame  # the rows priced (diag.forecast.costs.COLUMNS): what an ETA reads


def project_job(train: TrainConfig, job: QLoraConfig, comparison: QLoraResult,
                inputs: JobInputs) -> Projection:
    """Each plan of the comparison (of `job`, measured on `inputs`) over the whole job `train`."""
    recs = job_records(job, inputs.data_path, inputs.model_dir)  # the comparison's: a hit
    build = (read_meta(recs.cache.folder) or {}).get("build") or {}
    exact = recs.cache.complete  # every good record in the cache: counted exactly
    records = len(counted(train, recs.cache).indices) if exact else count_records(inputs.data_path)
    landed = sum(f.stat().st_size for f in shard_files(inputs.data_path))
    whole = int(comparison.frame["source_bytes"].max())
    built = 0 if exact else landed  # bytes the whole job still has to tokenize
    if whole > landed > 0:  # the comparison landed only the shards its records were in
        records, built, exact = round(records * whole / landed), whole, False
    per_record = float(np.minimum(recs.lengths, train.seq_len).mean())
    try:
        held = train.held_out(records)
    except ValueError as why:  # a source too small for one step of the whole job: said
        return Projection(pd.DataFrame([{"plan": p, "stage": "total", "seconds": float("nan"),
                                         "evidence": f"not projected: {records:,} records; {why}"}
                                        for p in comparison.frame["plan"]]), comparison.costs)
    steps = train.total_steps((records - held) // train.batch_size)
    per_step = train.batch_size * per_record
    epochs = steps * train.batch_size / (records - held)
    said = (f"{'' if exact else '~'}{records:,} records, ~{per_step * steps:,.0f} trained "
            f"tokens, {steps:,} steps of {train.batch_size} records, {epochs:.3g} "
            f"epoch{'s' * (round(epochs, 3) != 1)}")
    frames, priced = [], []
    for run in comparison.frame.itertuples():
        counts = job_counts(steps, train.warmup_steps, per_step, per_step / (1 - run.padding_share),
                            train.eval_cadence(steps, held),
                            train.cadence(train.checkpoint_every, steps), held * train.seq_len,
                            built_bytes=built, records=records)
        costs = runs_costs(comparison.costs, run.plan)
        if build.get("bytes") and build.get("seconds") and run.plan == "optimized":
            rate = f"{build['bytes'] / build['seconds'] / 1e6:.3g} MB/s"  # a byte tokenized (wall)
            byte = row(run.plan, "preprocess", "byte", build["seconds"], build["bytes"],
                       evidence=f"the token cache's recorded build: {rate} with "
                                f"{build.get('processes', '?')} processes")
            costs = pd.concat([costs, table(measured([byte]))], ignore_index=True)
        priced.append(costs)
        mine = price(costs, counts)
        total = {"plan": run.plan, "stage": "total",
                 **mine[["seconds", "low", "high"]].sum().astype(float).to_dict(), "evidence": said}
        frames.append(pd.concat([pd.DataFrame([total]), mine], ignore_index=True))
    return Projection(pd.concat(frames, ignore_index=True), pd.concat(priced, ignore_index=True))
