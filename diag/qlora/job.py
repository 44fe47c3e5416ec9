"""One QLoRA run under one plan: fetch the data, load the 4-bit base, tokenize, train, checkpoint,
each stage timed (`run_plan` -> PlanRun: stages, losses, cost rows, what ran)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from diag.files import scratch_folder
from diag.forecast.costs import measured, row
from diag.forecast.eta import run_counts
from diag.machine.device import resolve
from diag.qlora.base import REUSED, Bases, Sources, model_folder
from diag.qlora.checkpoints import last_checkpoint
from diag.qlora.data import WholeSteps, build_dataset, job_records
from diag.qlora.plans import Plan
from diag.qlora.trainer import fit, frozen_heap, trainer_for
from diag.secrets import register
from diag.timing import StageTimer, distributed

if TYPE_CHECKING:
    from diag.config import JobConfig, QLoraConfig


@contextlib.contextmanager
def open_sources(cfg: JobConfig) -> Iterator[Sources]:
    """The user's source and model, or the embedded S3 server and hub (started, then stopped)."""
    from diag.embedded import HubServer, S3Server, ensure_assets
    from diag.model_load import cache_dir_for, not_in_user_cache, snapshot_folder, user_cache
    from diag.storage import source_client

    cache, read_only = cache_dir_for(cfg), user_cache(cfg) and not cfg.repair_cache
    # a hub id the optimized plan would read from your own HF cache, which lacks it: refused first
    if read_only and cfg.plan != "naive" and not snapshot_folder(cache, cfg.model, cfg.revision):
        raise not_in_user_cache(cfg.model, cfg.revision, cache)
    with contextlib.ExitStack() as stack:
        if cfg.source:  # every source flag reaches the client (SourceConfig)
            url, client = cfg.source, source_client(cfg)
        else:
            s3 = stack.enter_context(S3Server())
            register(s3.secret_key)
            s3.upload(ensure_assets().dataset, "qlora/dataset.jsonl")
            url, client = f"s3://{s3.bucket}/qlora/dataset.jsonl", source_client(cfg, s3)
        if cfg.model:  # a local folder (checked for weights by SourceConfig) by its whole path
            local = Path(cfg.model).expanduser()
            model, endpoint = str(local.resolve()) if local.is_dir() else cfg.model, None
        else:
            assets = ensure_assets()
            hub = stack.enter_context(HubServer(assets.hub_root))
            model, endpoint = assets.repo_id, hub.endpoint
        yield Sources(url, client, model, endpoint, cfg.revision, cache, read_only)


def fetch_data(plan: Plan, src: Sources, work: Path, records: int = 0) -> tuple[Path, int, int]:
    """The data the job trains on, per plan.fetch: (its path, bytes fetched, the source's bytes)."""
    from diag.storage import fetch

    return fetch(src.url, src.client, plan.fetch, work, records)


def prepare(cfg: QLoraConfig, plan: Plan, src: Sources) -> tuple[Path, Path, Any]:
    """A start's inputs under plan, untimed: the data path, the model folder, the built dataset."""
    work = scratch_folder("diag-qlora-prime")  # a killed rank's is swept next time
    try:
        path, folder = fetch_data(plan, src, work, cfg.records)[0], model_folder(plan, src, work)
        return path, folder, build_dataset(cfg, plan, job_records(cfg, path, folder), folder, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class PlanRun:
    """One timed run of a plan: what it measured and what ran, read back."""

    plan: str
    round: int
    stages: pd.DataFrame  # StageTimer rows of every rank (`run` = the plan)
    losses: pd.DataFrame  # step, loss, learning_rate
    costs: pd.DataFrame  # measurement rows (diag.forecast.costs.MEASURED)
    summary: Mapping[str, Any]  # settings read back from what ran, tokens, slots, seconds


def run_plan(cfg: QLoraConfig, plan: Plan, src: Sources, bases: Bases | None = None,
             rnd: int = 0) -> PlanRun:
    """One timed run (round `rnd`) in a frozen heap. bases: the comparison's; None: loaded here."""
    import transformers

    with frozen_heap(), contextlib.nullcontext(bases) if bases else Bases() as bases:
        device, seat = rank_device(cfg)
        plan = plan.for_device(str(device))
        timer = StageTimer(device=device)  # on CUDA every stage boundary is a sync point
        work = scratch_folder(f"diag-qlora-{plan.name}")  # a killed rank's is swept next time
        out_dir = Path(cfg.out_dir) / plan.name if cfg.out_dir else work / "out"
        transformers.logging.set_verbosity_error()
        cpu: dict[str, float] = {}
        try:
            with timer.stage("fetch_data"), _cpu(cpu, "fetch_data"):
                data_path, fetched, source_bytes = fetch_data(plan, src, work, cfg.records)
            folder, model, reused = bases.load(cfg, plan, src, device, timer)
            check = time.perf_counter()  # untimed as a stage (the same in both plans), but shown
            recs = job_records(cfg, data_path, folder)
            check_s = time.perf_counter() - check
            with timer.stage("preprocess"), _cpu(cpu, "preprocess"):
                data = build_dataset(cfg, plan, recs, folder, data_path,
                                     model.config._attn_implementation)
            dataset = data.dataset
            if seat.rank == cfg.slow_rank:  # a straggler on purpose: slow_ms more per batch
                dataset = _Slowed(dataset, cfg.slow_ms / 1000 / data.micro_batch)
            trainer_cpu = time.process_time()
            trainer, callback = trainer_for(cfg, plan, model, data, out_dir, device, timer,
                                            train_dataset=dataset)
            resume = last_checkpoint(out_dir) if cfg.resume else None
            wall = fit(trainer, callback, resume, cfg.out_dir or None)  # resumed with its --out-dir
            cpu |= callback.cpu  # the warm-up's and the steady loop's
            cpu["setup"] = time.process_time() - trainer_cpu - cpu["warmup"] - cpu["train"]
            losses = pd.DataFrame([{"step": h["step"], "loss": h["loss"],
                                    "learning_rate": h.get("learning_rate")}
                                   for h in trainer.state.log_history if "loss" in h])
            frame = distributed.gathered_frame(timer)  # every rank's rows on rank 0
            if reused:  # every rank reused its own base in this round
                frame.loc[frame["stage"] == "load_model", "basis"] = REUSED
            # the run-level stages, end to end (nothing counted twice), one rank's
            ranks = max(frame["rank"].nunique(), 1)
            stages = (frame[frame["step"].isna()].groupby("stage")["seconds"].sum() / ranks)
            summary = {**data.stats, "plan": plan.name, "round": rnd,
                       "seconds": float(stages.sum()),
                       "warmup_steps": int((frame["stage"] == "warmup").sum()) // ranks,
                       "saves": int((frame["stage"] == "checkpoint").sum()) // ranks,
                       "ranks": seat.world_size, "steps": trainer.state.global_step,
                       "trainer_wall_s": wall, "check_s": check_s, "fetched_bytes": fetched,
                       "source_bytes": source_bytes,
                       "resumed_from_step": int(resume.name.split("-")[1]) if resume else 0,
                       **ran(trainer),
                       "final_loss": float(losses["loss"].iloc[-1]) if not losses.empty else None,
                       "notes": " ".join(plan.notes)}
            costs = _measured(plan.name, rnd, stages.to_dict(), summary, cpu,
                              bases.timed[plan.name])
            return PlanRun(plan.name, rnd, frame.assign(run=plan.name),
                           losses.assign(run=plan.name), costs, summary)
        finally:
            bases.release()  # the adapter off the kept base: the next round starts from its load
            shutil.rmtree(work, ignore_errors=True)


def rank_device(cfg: JobConfig) -> tuple[Any, Any]:
    """(the device this process trains on, its DDP seat, joined here; a no-op's unlaunched)."""
    import torch

    device = resolve(cfg.device)
    seat = distributed.init_group(device.type)
    if seat.distributed and device.type == "cuda":
        device = torch.device("cuda", seat.local_rank)  # each rank's base on its own GPU
    return device, seat


@contextlib.contextmanager
def _cpu(into: dict[str, float], stage: str) -> Iterator[None]:
    start = time.process_time()
    try:
        yield
    finally:
        into[stage] = time.process_time() - start


def _measured(plan: str, rnd: int, wall: dict[str, float], summary: Mapping[str, Any],
              cpu: Mapping[str, float], load: Mapping[str, Mapping[str, float]]) -> pd.DataFrame:
    """The run's cost rows: per run-level stage its unit and seconds, wall (one rank's) and CPU."""
    wall |= {stage: load[stage]["wall"] for stage in ("load_model", "download")}
    cpu = dict(cpu) | {stage: load[stage]["CPU"] for stage in ("load_model", "download")}
    n = run_counts(summary)
    units = {"fetch_data": "source", "load_model": "start", "download": "start",
             "preprocess": "record" if plan == "naive" else "start", "setup": "start",
             "warmup": "warmup_slot", "train": "slot", "checkpoint": "save"}
    said = f"the {plan} run of {summary['records']} records, {summary['steps']} steps"
    rows = [row(plan, stage, unit, got[stage], n[unit], clock=clock, rnd=rnd, evidence=said)
            for clock, got in (("wall", wall), ("CPU", cpu))
            for stage, unit in units.items() if got.get(stage) is not None and n[unit] > 0]
    return measured(rows)


def ran(trainer: Any) -> dict[str, Any]:
    """The plan's settings read back from what ran, never copied from the plan."""
    loader = trainer.callback_handler.train_dataloader  # the one train() iterated
    served = getattr(loader.dataset, "dataset", loader.dataset)  # under _Slowed
    # accelerate's loader batches through its batch sampler (its own batch_size is None)
    return {"micro_batch": loader.batch_size or loader.batch_sampler.batch_size,
            "grad_accum": trainer.args.gradient_accumulation_steps,
            "num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
            "pipeline": "packed" if isinstance(served, WholeSteps) else "naive",
            "gradient_checkpointing": trainer.model.is_activation_checkpointing}


class _Slowed:
    """The dataset, each row `seconds` later: a rank's loader made slow on purpose."""

    def __init__(self, dataset: Any, seconds: float) -> None:
        self.dataset, self.seconds = dataset, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.seconds)
        return self.dataset[i]
