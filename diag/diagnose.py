"""`python -m diag run`: the whole diagnosis, on the embedded defaults or the user's source.

`_recipe` reads top to bottom: the machine, the data's and the model's starts, the job's decisions
on its own step, the job naive vs optimized, the whole job projected, with --train the fine-tune
(`qlora=False`: the toy loop). Each step's product goes into one frozen `Diagnosis`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd
from tqdm.auto import tqdm

from diag import preflight, report, storage
from diag.config import (AccumConfig, DiagnoseConfig, InfoConfig, LoaderConfig, QLoraConfig,
                         ToyConfig, TrainConfig)
from diag.decision import Decision, by_setting
from diag.forecast.budget import Budget, of_run
from diag.frames import folder_frames
from diag.machine.contention import Contention, busy
from diag.machine.device import on_cpu_threads, resolve, run_info
from diag.model_load import ModelLoadResult, run_model_load
from diag.qlora import QLoraResult, TrainResult, measure, run_train
from diag.qlora.checkpointing import CheckpointingResult
from diag.qlora.experiment import Projection, compare, project_job
from diag.qlora.job import open_sources
from diag.qlora.measure import JobInputs
from diag.qlora.plans import Plan
from diag.runner import Runner, Step
from diag.storage import StorageResult
from diag.timing import StageTimer, median_seconds

if TYPE_CHECKING:
    from diag.accum import AccumResult
    from diag.loader import LoaderResult

RUNS = ("naive", "optimized")
T = TypeVar("T")


@dataclass(frozen=True)
class Diagnosis:
    """Each step's product, in the order the steps run; None: not run, or failed (on_error)."""

    info: pd.DataFrame | None = None  # what the machine is
    storage: StorageResult | None = None
    model_load: ModelLoadResult | None = None
    job: JobInputs | None = None  # the QLoRA job's landed data, cached model, rows per step
    accum: AccumResult | None = None  # on the job's step (qlora=False: the tiny model's)
    checkpointing: CheckpointingResult | None = None
    loader: LoaderResult | None = None  # on the job's step (qlora=False: projected)
    qlora: QLoraResult | None = None  # the job under both plans
    qlora_projection: Projection | None = None  # the whole job under each plan, projected
    loader_projected: LoaderResult | None = None  # on a CPU box: against target_gpu's step
    runs: pd.DataFrame | None = None  # qlora=False: the toy loop's two runs (StageTimer rows)
    accum_advice: pd.DataFrame | None = None  # the faster split, priced on the runs' compute
    train: TrainResult | None = None  # --train: the optimized plan on the whole dataset


INFO = Step("device facts", "info")
STORAGE = Step("storage", "storage")
MODEL_LOAD = Step("model load", "model_load")
JOB = Step("the job's inputs", "job")
ACCUM = Step("grad-accum sweep", "accum")
CHECKPOINTING = Step("checkpointing", "checkpointing")
LOADER = Step("data loader", "loader")
QLORA = Step("naive vs optimized QLoRA", "qlora")
PROJECTION = Step("the whole job, projected", "qlora_projection")
TRAIN = Step("the fine-tune: the optimized plan on the whole dataset", "train")
LOADER_PROJECTED = Step("data loader against target_gpu (projected)", "loader_projected")
LOADER_TOY = Step("data loader (projected)", "loader")
ACCUM_TOY = Step("grad-accum sweep (tiny model)", "accum")
TOY_RUNS = Step("naive vs optimized run", "runs")
ACCUM_ADVICE = Step("grad-accum advice", "accum_advice")
STEPS = (INFO, STORAGE, MODEL_LOAD, JOB, ACCUM, CHECKPOINTING, LOADER, QLORA, PROJECTION,
         LOADER_PROJECTED, LOADER_TOY, ACCUM_TOY, TOY_RUNS, ACCUM_ADVICE, TRAIN)  # panel order

# run(diagnosis, step, make): make() is the step's product, assigned into step.field (Runner)
Run = Callable[[Diagnosis, Step, Callable[[], Any]], Diagnosis]


def _recipe(cfg: DiagnoseConfig, run: Run, budget: Budget | None = None) -> Diagnosis:
    """The diagnosis, top to bottom; the steps that size their work get their budget shares."""
    share = budget.share if budget else lambda step: 0.0
    d = run(Diagnosis(), INFO, lambda: run_info(InfoConfig.default(quick=_quick(cfg))))
    if cfg.storage:
        d = run(d, STORAGE, lambda: storage.run_storage(cfg.storage_config(share(STORAGE))))
    if cfg.model_load:
        d = run(d, MODEL_LOAD, lambda: run_model_load(
            cfg.model_load_config().replace(budget_s=share(MODEL_LOAD))))
    d = _on_job(cfg, run, d, job_config(cfg, budget), budget) if cfg.qlora else \
        _toy(cfg, run, d)
    if cfg.accum:  # after the runs: its advice is priced on their compute
        d = run(d, ACCUM_ADVICE, lambda: _accum_advice(cfg, d))
    if cfg.qlora and cfg.train:  # the last step: the fine-tune, checked against the projection
        d = run(d, TRAIN, lambda: _train(cfg, d))
    return d


def _on_job(cfg: DiagnoseConfig, run: Run, d: Diagnosis, job: QLoraConfig,
            budget: Budget | None) -> Diagnosis:
    """The job's decisions on its step, then its runs (its sources open until they end)."""
    with contextlib.ExitStack() as stack:
        # opened once, by the first step that calls src() (a failed open: the next one retries)
        src = functools.cache(lambda: stack.enter_context(open_sources(job)))
        d = run(d, JOB, lambda: measure.job_inputs(job, src()))
        # the decisions in one order and budget split (measure.OnJob, as diag qlora's)
        shares = {"accum": ACCUM, "checkpointing": CHECKPOINTING, "loader": LOADER}
        on = functools.cache(lambda: stack.enter_context(contextlib.closing(measure.OnJob(
            job, _need(d.job, JOB), (lambda n: budget.share(shares[n])) if budget else None))))
        if cfg.accum:
            d = run(d, ACCUM, lambda: on().accum())
        d = run(d, CHECKPOINTING, lambda: on().checkpointing(_micro(d)))
        if cfg.loader:
            d = run(d, LOADER, lambda: on().loader(_micro(d)))
        if d.job is not None:
            on().close()  # their bases go before the runs load theirs
        # the optimized plan collects the decisions above; its extra rounds take its share's rest
        d = run(d, QLORA, lambda: compare(job, _decided(d), src(), max(
            0.0, budget.share(QLORA) - budget.floor(QLORA)) if budget else None))
        # what `diag train` would take on every record of the source for cfg.epochs, per plan
        d = run(d, PROJECTION, lambda: project_job(TrainConfig.of_job(job, epochs=cfg.epochs),
                                                   job, _need(d.qlora, QLORA), _need(d.job, JOB)))
    # on a CPU box, also: would this loader keep up with the GPU being considered (projected)
    if cfg.loader and not cfg.quick_experiments and resolve(cfg.device).type == "cpu":
        d = run(d, LOADER_PROJECTED, lambda: _loader_toy(cfg, {  # the job's records
            "data": str(_need(d.job, JOB).data_path), "tokenizer": str(d.job.model_dir),
            **job.source_kwargs(LoaderConfig)}))
    return d


def _toy(cfg: DiagnoseConfig, run: Run, d: Diagnosis) -> Diagnosis:
    """qlora=False: the projected loader, the tiny model's sweep, the toy loop's two runs."""
    if cfg.loader:
        d = run(d, LOADER_TOY, lambda: _loader_toy(cfg))
    if cfg.accum:
        d = run(d, ACCUM_TOY, lambda: _accum_toy(cfg))
    return run(d, TOY_RUNS, lambda: training_runs(cfg, run_level(d.storage, d.model_load)))


def steps(cfg: DiagnoseConfig) -> list[Step]:
    """The steps cfg enables, in order: the recipe walked by a runner that runs none of them."""
    walked: list[Step] = []
    _recipe(cfg, lambda d, step, make: walked.append(step) or d)
    return walked


def _need(product: T | None, step: Step) -> T:
    """An earlier step's product a step reads; that step failed (its error shown) or did not run."""
    if product is None:
        raise RuntimeError(f"needs {step.name!r}, which did not finish")
    return product


def _quick(cfg: DiagnoseConfig) -> bool | None:
    return cfg.quick_experiments or None


def job_config(cfg: DiagnoseConfig, budget: Budget | None = None) -> QLoraConfig:
    """The QLoRA job the diagnosis measures and runs, its decisions' share of the budget."""
    given = {"sweep_workers": list(cfg.workers), "sweep_micro_batches": list(cfg.micro_batches),
             "records": cfg.records, "steps": cfg.job_steps, "seq_len": cfg.seq_len}
    preset = {} if cfg.quick_experiments else QLoraConfig.RUN
    given = preset | {k: v for k, v in given.items() if v}
    if budget is not None:  # 0 s too: a budget with no room above the floors repeats nothing
        given["decide_budget_s"] = budget.decide_s()
    return QLoraConfig.default(quick=_quick(cfg), device=cfg.device, plan=cfg.plan,
                               on_error=cfg.on_error, **cfg.source_kwargs(), **given)


def _micro(d: Diagnosis) -> int:
    """The micro-batch the job's measurements run at: the sweep's choice, else the plan's fit."""
    if d.accum is not None:
        return int(by_setting(d.accum.decisions)["micro_batch"].value)
    job = _need(d.job, JOB)
    return Plan.optimized(device=str(job.device)).fit(job.rows_per_step).micro_batch


def _decided(d: Diagnosis) -> list[Decision]:
    """The decisions measured on this source and job: what the optimized plan collects."""
    measured = (d.storage, d.model_load, d.loader, d.accum, d.checkpointing)
    return [x for r in measured if r is not None for x in r.decisions]


def _train(cfg: DiagnoseConfig, d: Diagnosis) -> TrainResult:
    """`diag train`: the optimized plan on the whole dataset, its ETA at the projection's costs."""
    costs = _need(d.qlora_projection, PROJECTION).costs
    train = TrainConfig.of_job(job_config(cfg), quick=_quick(cfg), epochs=cfg.epochs)
    return run_train(train, _decided(d), costs=costs[costs["plan"] == "optimized"])


def _loader_toy(cfg: DiagnoseConfig, records: dict[str, Any] | None = None) -> LoaderResult:
    """The loader against target_gpu's estimated step on records (None: the embedded data)."""
    from diag.loader import run_loader

    # an emulated step of that GPU's estimated duration: a projection
    sweep = dict(records or {}) | ({} if cfg.quick_experiments else dict(LoaderConfig.RUN))
    if resolve(cfg.device).type == "cpu" and not cfg.quick_experiments:
        sweep["gpu"] = cfg.target_gpu
    if cfg.workers:
        sweep["workers"] = list(cfg.workers)
    got = run_loader(LoaderConfig.default(quick=_quick(cfg), device=cfg.device,
                                          run_steps=cfg.steps, **sweep))
    if "gpu" not in sweep:
        return got
    projected = tuple(d if d.basis == "default" else dataclasses.replace(d, basis="projected")
                      for d in got.decisions)
    return dataclasses.replace(got, decisions=projected)


def _accum_toy(cfg: DiagnoseConfig) -> AccumResult:
    from diag.accum import run_accum

    cuda = resolve(cfg.device).type == "cuda"
    preset = {} if cfg.quick_experiments else AccumConfig.GPU if cuda else AccumConfig.CPU
    sweep = preset | ({"micro_batches": list(cfg.micro_batches)} if cfg.micro_batches else {})
    return run_accum(AccumConfig.default(quick=_quick(cfg), device=cfg.device, **sweep))


def _accum_advice(cfg: DiagnoseConfig, d: Diagnosis) -> pd.DataFrame:
    """The faster split's saving as a fraction of the naive run's compute (not the sweep's)."""
    from diag.accum import advice

    ran = _need(d.qlora, QLORA).stages if cfg.qlora else _need(d.runs, TOY_RUNS)
    compute = float(ran.loc[(ran["run"] == RUNS[0]) & (ran["stage"] == "compute"), "seconds"].sum())
    steps = d.qlora.frame["steps"].max() if d.qlora is not None else cfg.steps
    accum = _need(d.accum, ACCUM if cfg.qlora else ACCUM_TOY)
    return advice(accum.summary, int(steps), compute_s=compute)


def run_level(storage: StorageResult | None, model_load: ModelLoadResult | None
              ) -> dict[str, dict[str, float]]:
    """Per toy run, the start's seconds measured: naive pulls and downloads, optimized not."""
    fetch = by_setting(storage.decisions).get("fetch") if storage is not None else None
    loaded = getattr(model_load, "frame", None)
    measured = {
        "naive": {"fetch_data": fetch and fetch.baseline_s,
                  "load_model": median_seconds(loaded, scenario="fresh", part="load_model")},
        "optimized": {"fetch_data": fetch and fetch.value == "land" and fetch.chosen_s or None,
                      "load_model": median_seconds(loaded, scenario="cached", part="load_model")}}
    return {run: {stage: s for stage, s in seconds.items() if s is not None}
            for run, seconds in measured.items()}


def training_runs(cfg: DiagnoseConfig, run_level: dict[str, dict[str, float]] | None = None
                  ) -> pd.DataFrame:
    """Both toy runs in one frame (`run`), run_level's seconds on each timer before its steps."""
    from diag.loader.toy import run_toy

    device = resolve(cfg.device)
    out = []
    for run, workers in zip(RUNS, (cfg.naive_workers, cfg.optimized_workers)):
        timer = StageTimer(device=device)  # on CUDA every stage boundary is a sync point
        for stage, seconds in (run_level or {}).get(run, {}).items():
            timer.record(stage, seconds)
        toy = ToyConfig(steps=cfg.steps, prep_ms=cfg.prep_ms, num_workers=workers,
                        device=cfg.device, **({"width": 128} if cfg.steps < 20 else {}))
        out.append(run_toy(toy, timer).assign(run=run))
    return pd.concat(out, ignore_index=True)


def frames(d: Diagnosis, order: list[Step]) -> dict[str, pd.DataFrame]:
    """The run folder's frames in the order the steps ran (info, advice: report.write's own)."""
    return folder_frames((s.field, getattr(d, s.field)) for s in order
                         if s not in (INFO, ACCUM_ADVICE) and getattr(d, s.field) is not None)


@on_cpu_threads
def run_diagnose(cfg: DiagnoseConfig | None = None,
                 on_result: Callable[[Step, dict[str, pd.DataFrame]], None] | None = None,
                 stop: threading.Event | None = None,
                 on_error: Callable[[Step, Exception], None] | None = None) -> Path:
    """Run the diagnosis and write the report (the panel's hooks after, before, on error)."""
    cfg = cfg or DiagnoseConfig.default()
    job, order = job_config(cfg) if cfg.qlora else None, steps(cfg)
    # a budget too small for the steps is refused before any work (--train: outside it)
    budget = of_run(cfg, order, job)
    # everything checkable before the first experiment (the job's config first: its size)
    preflight.preflight(cfg, job)
    budget.say()  # the plan, before the first step

    def measured(step: Step, d: Diagnosis) -> None:
        # (info is absent only when the device-facts step failed under on_error)
        on_result(step, frames(d, order) | ({"info": d.info} if d.info is not None else {}))

    with preflight.covered(), tqdm(total=len(order), desc="diag run", unit="step") as bar, \
            Contention(resolve(cfg.device)) as machine:
        runner = Runner(bar, measured if on_result else None, stop, on_error)
        d = _recipe(cfg, budget.timed(runner), budget)
    budget.say(spent=True)
    if said := busy(machine.summary()):  # beside the plan, on stderr: --json stays JSON
        tqdm.write(said[0].upper() + said[1:], file=sys.stderr)
    advice = [r.advice for r in (d.storage, d.model_load, d.loader) if r is not None]
    advice = [a for a in [*advice, d.accum_advice] if a is not None and not a.empty]
    return report.write(frames(d, order) | {"budget": budget.frame(), "machine": machine.frame()},
                        cfg.out or None, config=cfg.to_dict(), info=d.info,
                        advice=pd.concat(advice, ignore_index=True) if advice else None,
                        machine=machine.summary())
