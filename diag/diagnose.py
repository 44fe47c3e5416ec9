"""The whole diagnosis on the embedded defaults (or the user's source): `python -m diag run`.

It measures what this machine is, pulls the dataset from the object store and lands it
(diag.storage), loads the model fresh and cached (diag.model_load), then measures the QLoRA job's
own step (diag.qlora.measure): micro-batch x grad-accum of the nf4 + LoRA model, checkpointing on
vs off, and the DataLoader sweep consuming that step; then runs the job twice (diag.qlora): the
naive plan as a newcomer runs it, the optimized plan collected from the decisions above.
(`qlora=False` runs the toy loop instead, the loader against the GPU being considered, with the
measured fetch and load costs on its timer.) Writes the run folder.

`STEPS` is the one list of steps: run_diagnose runs the enabled ones in order, each returning its
product (an experiment's result), and the widget panel (diag.widgets) reads the same list.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from diag import report
from diag.config import DiagnoseConfig, InfoConfig, QLoraConfig, ToyConfig
from diag.machine.device import on_cpu_threads
from diag.timing import STAGE_FRAME, StageTimer, is_stage_frame, median_seconds

RUNS = ("naive", "optimized")
Products = dict[str, Any]


@dataclass(frozen=True)
class Step:
    """One step of the diagnosis: `run(cfg, products so far)` returns its product, kept under
    `key` (its frames are stored as key, key_<field>)."""

    name: str  # what the progress bar and the panel show
    key: str
    run: Callable[[DiagnoseConfig, Products], Any]
    enabled: Callable[[DiagnoseConfig], bool] = lambda cfg: True


def _quick(cfg: DiagnoseConfig) -> bool | None:
    return cfg.quick_experiments or None


def job_config(cfg: DiagnoseConfig) -> QLoraConfig:
    """The QLoRA job the diagnosis measures and runs; the panel's sweep values go to its sweeps."""
    sweeps = {k: v for k, v in (("sweep_workers", list(cfg.workers)),
                                ("sweep_micro_batches", list(cfg.micro_batches))) if v}
    preset = {} if cfg.quick_experiments else QLoraConfig.RUN
    sized = {k: v for k, v in (("records", cfg.records), ("steps", cfg.job_steps),
                                ("seq_len", cfg.seq_len)) if v}
    return QLoraConfig.default(quick=_quick(cfg), device=cfg.device, plan=cfg.plan,
                               on_error=cfg.on_error, **cfg.source_kwargs(),
                               **(preset | sweeps | sized))


def _info(cfg: DiagnoseConfig, got: Products) -> pd.DataFrame:
    from diag.machine.device import run_info

    return run_info(InfoConfig.default(quick=_quick(cfg)))


def _storage(cfg: DiagnoseConfig, got: Products) -> Any:
    from diag.config import StorageConfig
    from diag.storage import run_storage

    preset = {} if cfg.quick_experiments else StorageConfig.RUN  # the embedded dataset's size
    return run_storage(StorageConfig.default(quick=_quick(cfg), **cfg.source_kwargs(), **preset))


def _model_load(cfg: DiagnoseConfig, got: Products) -> Any:
    from diag.config import ModelLoadConfig
    from diag.model_load import run_model_load

    # quick: the two scenarios the runs need; full: all four, for every advice row
    quick = {"scenarios": ["fresh", "cached"]} if cfg.quick_experiments else {}
    return run_model_load(ModelLoadConfig.default(quick=_quick(cfg), **cfg.source_kwargs(),
                                                  **quick))


# -- measured on the QLoRA job ------------------------------------------------------------------
class JobSources:
    """The job's sources (the embedded S3 server and hub, or the user's bucket and model), opened
    by the first step that reads them and closed when the diagnosis ends: the job's inputs and
    its runs read the same ones (one start of the embedded servers)."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack, self._src = stack, None

    def __call__(self, cfg: DiagnoseConfig) -> Any:
        if self._src is None:
            from diag.qlora.job import open_sources

            self._src = self._stack.enter_context(open_sources(job_config(cfg)))
        return self._src


SOURCES = "sources"  # their key among the products (no frames: the run folder never has it)


def _job(cfg: DiagnoseConfig, got: Products) -> Any:
    from diag.qlora.measure import job_inputs

    return job_inputs(job_config(cfg), got[SOURCES](cfg) if SOURCES in got else None)


def _accum_on_job(cfg: DiagnoseConfig, got: Products) -> Any:
    from diag.qlora.measure import accum_on_job

    return accum_on_job(job_config(cfg), got["job"])


def _micro(got: Products) -> int:
    from diag.decision import by_setting
    from diag.qlora.plans import Plan

    if "accum" in got:
        return int(by_setting(got["accum"].decisions)["micro_batch"].value)
    return Plan.optimized(device=str(got["job"].device)).fit(got["job"].rows_per_step).micro_batch


def _checkpointing(cfg: DiagnoseConfig, got: Products) -> Any:
    from diag.qlora.measure import checkpointing_on_job

    return checkpointing_on_job(job_config(cfg), got["job"], _micro(got))


def _loader_on_job(cfg: DiagnoseConfig, got: Products) -> Any:
    from diag.qlora.measure import loader_on_job

    return loader_on_job(job_config(cfg), got["job"], _micro(got))


def _qlora(cfg: DiagnoseConfig, got: Products) -> Any:
    """The QLoRA job under both plans; the optimized one collects the decisions above."""
    from diag.qlora import run_qlora

    measured = {k: got[k] for k in ("loader", "accum", "checkpointing") if k in got}
    # storage and model_load as frames: the run's predictions read their rows too
    measured |= {k: got[k].frame for k in ("storage", "model_load") if k in got}
    return run_qlora(job_config(cfg), results=measured,
                     src=got[SOURCES](cfg) if SOURCES in got else None)


# -- the toy loop (qlora=False) -------------------------------------------------------------------
def _loader_toy(cfg: DiagnoseConfig, got: Products) -> Any:
    from diag.config import LoaderConfig
    from diag.machine.device import resolve
    from diag.loader import run_loader

    # On a CPU box the question is whether this loader would keep up with the GPU being
    # considered: an emulated step of that GPU's estimated duration, a projection
    sweep = {} if cfg.quick_experiments else dict(LoaderConfig.RUN)
    if resolve(cfg.device).type == "cpu" and not cfg.quick_experiments:
        sweep["gpu"] = cfg.target_gpu
    if cfg.workers:
        sweep["workers"] = list(cfg.workers)
    got_ = run_loader(LoaderConfig.default(quick=_quick(cfg), device=cfg.device,
                                           run_steps=cfg.steps, **sweep))
    if "gpu" not in sweep:
        return got_
    projected = tuple(d if d.basis == "default" else dataclasses.replace(d, basis="projected")
                      for d in got_.decisions)
    return dataclasses.replace(got_, decisions=projected)


def _accum_toy(cfg: DiagnoseConfig, got: Products) -> Any:
    from diag.accum import run_accum
    from diag.config import AccumConfig
    from diag.machine.device import resolve

    cuda = resolve(cfg.device).type == "cuda"
    preset = {} if cfg.quick_experiments else AccumConfig.GPU if cuda else AccumConfig.CPU
    sweep = preset | ({"micro_batches": list(cfg.micro_batches)} if cfg.micro_batches else {})
    return run_accum(AccumConfig.default(quick=_quick(cfg), device=cfg.device, **sweep))


def _toy_runs(cfg: DiagnoseConfig, got: Products) -> pd.DataFrame:
    return training_runs(cfg, run_level(got))


def _accum_advice(cfg: DiagnoseConfig, got: Products) -> pd.DataFrame:
    """Ranked beside the other stages as the fraction of the naive run's compute the faster
    split saves (the sweep's own seconds are for its model, not this run's)."""
    from diag.accum import advice

    run = frames(got)[STAGE_FRAME]
    compute = float(run.loc[(run["run"] == RUNS[0]) & (run["stage"] == "compute"), "seconds"].sum())
    steps = got["qlora"].frame["steps"].max() if "qlora" in got else cfg.steps
    return advice(got["accum"].summary, int(steps), compute_s=compute)


def _on_cpu(cfg: DiagnoseConfig) -> bool:
    from diag.machine.device import resolve

    return resolve(cfg.device).type == "cpu"


def _qlora_on(cfg: DiagnoseConfig) -> bool:
    return cfg.qlora


STEPS: tuple[Step, ...] = (
    Step("device facts", "info", _info),
    Step("storage", "storage", _storage, lambda c: c.storage),
    Step("model load", "model_load", _model_load, lambda c: c.model_load),
    Step("the job's inputs", "job", _job, _qlora_on),
    # before the runs: the optimized plan collects these decisions, measured on the job
    Step("grad-accum sweep", "accum", _accum_on_job, lambda c: c.qlora and c.accum),
    Step("checkpointing", "checkpointing", _checkpointing, _qlora_on),
    Step("data loader", "loader", _loader_on_job, lambda c: c.qlora and c.loader),
    Step("naive vs optimized QLoRA", "qlora", _qlora, _qlora_on),
    # on a CPU box, also: would this loader keep up with the GPU being considered (projected)
    Step("data loader against target_gpu (projected)", "loader_projected", _loader_toy,
         lambda c: c.qlora and c.loader and not c.quick_experiments and _on_cpu(c)),
    Step("data loader (projected)", "loader", _loader_toy, lambda c: not c.qlora and c.loader),
    Step("grad-accum sweep (tiny model)", "accum", _accum_toy,
         lambda c: not c.qlora and c.accum),
    Step("naive vs optimized run", "runs", _toy_runs, lambda c: not c.qlora),
    # after the runs: its advice is priced on their compute
    Step("grad-accum advice", "accum_advice", _accum_advice, lambda c: c.accum),
)


def steps(cfg: DiagnoseConfig) -> list[Step]:
    """The steps cfg enables, in order."""
    return [s for s in STEPS if s.enabled(cfg)]


def run_level(got: Products) -> dict[str, dict[str, float]]:
    """Per toy run, the run-level stage seconds the experiments measured: a naive start re-pulls
    with boto3's defaults and downloads the model; an optimized one finds the landed copy (a
    verified land() hit) and the warm cache."""
    out: dict[str, dict[str, float]] = {r: {} for r in RUNS}
    storage, load = (getattr(got.get(k), "frame", None) for k in ("storage", "model_load"))
    for run, fetch, scenario in (("naive", {"method": "boto3_default"}, "fresh"),
                                 ("optimized", {"method": "land", "cache_state": "hit"},
                                  "cached")):
        for stage, seconds in (("fetch_data", median_seconds(storage, **fetch)),
                               ("load_model", median_seconds(load, scenario=scenario,
                                                             part="load_model"))):
            if seconds is not None:
                out[run][stage] = seconds
    return out


def training_runs(cfg: DiagnoseConfig, run_level: dict[str, dict[str, float]] | None = None
                  ) -> pd.DataFrame:
    """The naive and the optimized toy run in one frame (`run` column); run_level seconds are
    recorded on each run's timer before its steps."""
    from diag.machine.device import resolve
    from diag.toy import run_toy

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


def frames(got: Products) -> dict[str, pd.DataFrame]:
    """The products as the run folder's frames: a result's first frame under its key, the others
    as key_<field>, a StageTimer frame under the one stage key, every decision in `decisions`."""
    from diag.decision import frame

    out: dict[str, pd.DataFrame] = {}
    for key, product in got.items():
        if key in ("info", "accum_advice") or not (
                isinstance(product, pd.DataFrame) or dataclasses.is_dataclass(product)):
            continue
        fields = ([("frame", product)] if isinstance(product, pd.DataFrame) else
                  [(f.name, getattr(product, f.name)) for f in dataclasses.fields(product)])
        for i, (name, value) in enumerate(fields):
            if not isinstance(value, pd.DataFrame) or name == "advice" or value.empty:
                continue
            label = STAGE_FRAME if is_stage_frame(value) else key if i == 0 else f"{key}_{name}"
            out[label] = value
    decisions = [d for p in got.values() for d in getattr(p, "decisions", ())]
    if decisions:
        out["decisions"] = frame(decisions)
    return out


def advice(got: Products) -> pd.DataFrame | None:
    rows = [got[k].advice for k in ("storage", "model_load", "loader") if k in got]
    rows += [got["accum_advice"]] if "accum_advice" in got else []
    rows = [a for a in rows if not a.empty]
    return pd.concat(rows, ignore_index=True) if rows else None


OnResult = Callable[[Step, dict[str, pd.DataFrame]], None]
OnError = Callable[[Step, Exception], None]


class Stopped(BaseException):
    """The diagnosis was stopped (the panel's Stop); a BaseException so that no step's error
    handling swallows it. Nothing is written: a run folder appears whole or not at all."""


@on_cpu_threads
def run_diagnose(cfg: DiagnoseConfig | None = None, on_result: OnResult | None = None,
                 stop: threading.Event | None = None, on_error: OnError | None = None) -> Path:
    """Run the diagnosis and write the report; returns the run folder.

    on_result(step, frames measured so far) is called after each step, so a panel
    (diag.widgets) can draw each experiment's figure as it arrives; the CLI passes none.
    stop: checked before each step; once set, raises Stopped. on_error(step name, error): a step
    that raises is handed to it and the other steps go on (without it the error propagates).
    """
    from diag.preflight import preflight

    cfg = cfg or DiagnoseConfig.default()
    preflight(cfg, out=cfg.out, data=cfg.qlora)  # flags checked before the first experiment
    with contextlib.ExitStack() as stack:
        got: Products = {SOURCES: JobSources(stack)}
        _run_steps(cfg, got, on_result, stop, on_error)
    del got[SOURCES]
    return report.write(frames(got), cfg.out or None, config=cfg.to_dict(), info=got.get("info"),
                        advice=advice(got))


def _run_steps(cfg: DiagnoseConfig, got: Products, on_result: OnResult | None,
               stop: threading.Event | None, on_error: OnError | None) -> None:
    with tqdm(steps(cfg), desc="diag run", unit="step") as bar:
        for step in bar:
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped before {step.name}")
            bar.set_postfix_str(step.name)
            try:
                got[step.key] = step.run(cfg, got)
            except Exception as error:
                if on_error is None:
                    raise
                on_error(step, error)
                continue
            if on_result is not None:
                # (info is absent only when the device-facts step failed under on_error)
                on_result(step, dict(frames(got), **({"info": got["info"]} if "info" in got
                                                      else {})))
