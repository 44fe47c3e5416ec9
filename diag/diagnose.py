"""The whole diagnosis on the embedded defaults (or the user's source): `python -m diag run`.

It measures what this machine is, pulls the dataset from the object store and lands it
(diag.storage), loads the model fresh and cached (diag.model_load), sweeps the DataLoader against
a training step (diag.loader), sweeps micro-batch x grad-accum (diag.accum), then runs the QLoRA
job twice (diag.qlora): the naive plan as a newcomer runs it, the optimized plan built from the
frames measured above. (`qlora=False` runs the toy loop instead, with the measured fetch and
load costs on its timer.) Writes the run folder.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from diag import report
from diag.config import DiagnoseConfig, InfoConfig, ToyConfig
from diag.timing import StageTimer, median_seconds

RUNS = ("naive", "optimized")


def training_runs(cfg: DiagnoseConfig, run_level: dict[str, dict[str, float]] | None = None
                  ) -> pd.DataFrame:
    """The naive and the optimized run in one frame (`run` column).

    run_level: per run, run-level stage seconds measured by the experiments (fetch_data from
    diag.storage, load_model from diag.model_load), recorded on the run's timer before its steps.
    """
    from diag.device import resolve
    from diag.toy import run_toy

    device = resolve(cfg.device)
    frames = []
    for run, workers in zip(RUNS, (cfg.naive_workers, cfg.optimized_workers)):
        timer = StageTimer(device=device)  # on CUDA every stage boundary is a sync point
        for stage, seconds in (run_level or {}).get(run, {}).items():
            timer.record(stage, seconds)
        toy = ToyConfig(steps=cfg.steps, prep_ms=cfg.prep_ms, num_workers=workers,
                            device=cfg.device, **({"width": 128} if cfg.steps < 20 else {}))
        frames.append(run_toy(toy, timer).assign(run=run))
    return pd.concat(frames, ignore_index=True)


def _storage(cfg: DiagnoseConfig, results: dict[str, Any]) -> None:
    from diag.config import StorageConfig
    from diag.storage import run_storage

    got = run_storage(StorageConfig.default(quick=cfg.quick_experiments or None, source=cfg.source))
    frame = got.frame
    results["frames"].update(storage=frame, storage_tax=got.tax)
    results["advice"].append(got.advice)
    # a naive start re-pulls with the defaults users get from boto3 / `aws s3 cp`; an optimized
    # start finds the landed copy (a verified land() hit)
    naive = median_seconds(frame, method="boto3_default")
    hit = median_seconds(frame, method="land", cache_state="hit")
    for run, seconds in (("naive", naive), ("optimized", hit)):
        if seconds is not None:
            results["run_level"][run]["fetch_data"] = seconds


def _model_load(cfg: DiagnoseConfig, results: dict[str, Any]) -> None:
    from diag.config import ModelLoadConfig
    from diag.model_load import advice, run_model_load

    # quick: the two scenarios the runs need; full: all four, for every advice row
    quick = {"scenarios": ["fresh", "cached"]} if cfg.quick_experiments else {}
    frame = run_model_load(ModelLoadConfig.default(quick=cfg.quick_experiments or None,
                                                   model=cfg.model, **quick))
    results["frames"]["model_load"] = frame
    results["advice"].append(advice(frame))
    # naive: an empty cache on every start (the full download); optimized: the warm cache
    for run, scenario in (("naive", "fresh"), ("optimized", "cached")):
        seconds = median_seconds(frame, scenario=scenario, part="load_model")
        if seconds is not None:
            results["run_level"][run]["load_model"] = seconds


def _accum(cfg: DiagnoseConfig, results: dict[str, Any]) -> None:
    from diag.accum import run_accum
    from diag.config import AccumConfig
    from diag.device import resolve

    # on a GPU the full sweep trains the GPT-2-small shape; the tiny model would measure overhead
    gpu = AccumConfig.GPU if resolve(cfg.device).type == "cuda" and not cfg.quick_experiments else {}
    if not gpu and not cfg.quick_experiments:
        # on a CPU three points span the trade-off (the seed's many small micro-batches, the
        # middle, one large one); every power of two costs minutes here and adds no finding
        gpu = {"micro_batches": [2, 8, 32], "steps": 2}
    sweep = gpu | ({"micro_batches": list(cfg.micro_batches)} if cfg.micro_batches else {})
    accum_cfg = AccumConfig.default(quick=cfg.quick_experiments or None, device=cfg.device, **sweep)
    got = run_accum(accum_cfg)
    results["frames"].update(accum=got.frame, accum_summary=got.summary, accum_mfu=got.mfu)
    results["accum_steps_per_run"] = accum_cfg.steps_per_run


def _accum_advice(results: dict[str, Any]) -> None:
    """Ranked beside the other stages as the fraction of the naive run's compute the faster
    split saves (the sweep's own seconds are for its model, not this run's)."""
    from diag.accum import advice

    run = results["frames"]["run"]
    compute = float(run.loc[(run["run"] == RUNS[0]) & (run["stage"] == "compute"), "seconds"].sum())
    results["advice"].append(advice(results["frames"]["accum_summary"],
                                    results["accum_steps_per_run"], compute_s=compute))


def _loader(cfg: DiagnoseConfig, results: dict[str, Any]) -> None:
    from diag.config import LoaderConfig
    from diag.loader import run_loader

    from diag.device import resolve

    # On a CPU box the question is whether this loader would keep up with the GPU being
    # considered: an emulated step of that GPU's estimated duration (measuring the tiny model's
    # step on a CPU takes seconds per step and answers a question nobody asked). On a GPU the
    # measured step is the real one. The advice is priced for this diagnosis' runs.
    sweep = {} if cfg.quick_experiments else {"steps": 10, "repeats": 1}
    if resolve(cfg.device).type == "cpu" and not cfg.quick_experiments:
        sweep["gpu"] = cfg.target_gpu
    if cfg.workers:
        sweep["workers"] = list(cfg.workers)
    got = run_loader(LoaderConfig.default(quick=cfg.quick_experiments or None, device=cfg.device,
                                          run_steps=cfg.steps, **sweep))
    results["frames"].update(loader=got.sweep, loader_stalls=got.stalls, loader_lines=got.lines,
                             loader_recommendation=got.recommendation)
    results["advice"].append(got.advice)


# -- qlora ---------------------------------------------------------------------------------------
def _qlora(cfg: DiagnoseConfig, results: dict[str, Any]) -> None:
    """The QLoRA job under both plans; the optimized one reads the frames measured above."""
    from diag.config import QLoraConfig
    from diag.qlora import run_qlora

    frames = results["frames"]
    measured = {k: frames[k] for k in ("storage", "model_load", "loader", "accum") if k in frames}
    got = run_qlora(QLoraConfig.default(quick=cfg.quick_experiments or None, model=cfg.model,
                                        device=cfg.device, plan=cfg.plan), results=measured)
    frames.update(run=got.stages, qlora=got.frame, qlora_losses=got.losses,
                  qlora_plans=got.plans, qlora_savings=got.savings)


OnResult = Callable[[str, dict[str, pd.DataFrame]], None]
OnError = Callable[[str, Exception], None]


class Stopped(BaseException):
    """The diagnosis was stopped (the panel's Stop); a BaseException so that no step's error
    handling swallows it. Nothing is written: a run folder appears whole or not at all."""


def run_diagnose(cfg: DiagnoseConfig | None = None, on_result: OnResult | None = None,
                 stop: threading.Event | None = None, on_error: OnError | None = None) -> Path:
    """Run the diagnosis and write the report; returns the run folder.

    on_result(step name, frames measured so far) is called after each step, so a panel
    (diag.widgets) can draw each experiment's figure as it arrives; the CLI passes none.
    stop: checked before each step; once set, raises Stopped. on_error(step name, error): a step
    that raises is handed to it and the other steps go on (without it the error propagates).
    """
    from diag.device import run_info

    cfg = cfg or DiagnoseConfig.default()
    results: dict[str, Any] = {"frames": {}, "advice": [], "run_level": {r: {} for r in RUNS}}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("device facts", lambda: results.update(
            info=run_info(InfoConfig.default(quick=cfg.quick_experiments or None))))]
    if cfg.storage:
        steps.append(("storage", lambda: _storage(cfg, results)))
    if cfg.model_load:
        steps.append(("model load", lambda: _model_load(cfg, results)))
    if cfg.loader:
        steps.append(("data loader", lambda: _loader(cfg, results)))
    if cfg.accum:  # before the runs: the optimized plan takes its micro-batch from the sweep
        steps.append(("grad-accum sweep", lambda: _accum(cfg, results)))
    if cfg.qlora:
        steps.append(("naive vs optimized QLoRA", lambda: _qlora(cfg, results)))
    else:
        steps.append(("naive vs optimized run", lambda: results["frames"].update(
            run=training_runs(cfg, results["run_level"]))))
    if cfg.accum:  # after the runs: its advice is priced on their compute
        steps.append(("grad-accum advice", lambda: _accum_advice(results)))
    with tqdm(steps, desc="diag run", unit="step") as bar:
        for name, work in bar:
            if stop is not None and stop.is_set():
                raise Stopped(f"stopped before {name}")
            bar.set_postfix_str(name)
            try:
                work()
            except Exception as error:
                if on_error is None:
                    raise
                on_error(name, error)
                continue
            if on_result is not None:
                # (device facts' info is absent only when that step failed under on_error)
                on_result(name, dict(results["frames"], **(
                    {"info": results["info"]} if "info" in results else {})))
    advice = [a for a in results["advice"] if not a.empty]
    return report.write(results["frames"], cfg.out or None, config=cfg.to_dict(),
                        info=results.get("info"),
                        advice=pd.concat(advice, ignore_index=True) if advice else None)
