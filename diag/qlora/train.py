"""`diag train`: one plan trains the whole dataset, every stage timed, its projection said before
the first step, its ETA once the steps have a pace, both checked after the last; the adapter it
leaves in out_dir is the output."""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from diag.config import TrainConfig
from diag.data import count_records, read_meta
from diag.decision import Decision, read
from diag.decision import frame as decisions_frame
from diag.files import scratch_folder
from diag.forecast.costs import price
from diag.forecast.eta import (after_line, before_line, check_eta, costs_in, duration,
                               from_decisions, job_counts)
from diag.machine.device import on_cpu_threads, resolve
from diag.preflight import preflight
from diag.qlora.base import Sources, load_model, model_folder
from diag.qlora.checkpoints import (PACKED_ROWS, check, last_checkpoint, merged, publish,
                                    record)
from diag.qlora.data import (ArrowRecords, Data, Split, build_dataset, job_records,
                             train_records)
from diag.qlora.job import fetch_data, open_sources
from diag.qlora.measure import job_inputs, measure_on_job, read_results
from diag.qlora.plans import Plan
from diag.qlora.trainer import fit, frozen_heap, progress_callback, trainer_for
from diag.runner import say
from diag.timing import StageTimer


@dataclass(frozen=True)
class TrainResult:
    """What `run_train` returns (first field: the main table)."""

    frame: pd.DataFrame  # one row: the run (records, steps, tokens, seconds, eval losses, out_dir)
    stages: pd.DataFrame  # StageTimer rows (`run` = the plan)
    losses: pd.DataFrame  # run, split (train / eval), step, trained_tokens, loss, learning_rate
    eta: pd.DataFrame  # stage, predicted_s (before the run), measured_s, error_share, flagged
    plans: pd.DataFrame  # the plan that ran: setting, value, basis, evidence (its decisions)


def run_train(cfg: TrainConfig | None = None, decisions: Iterable[Decision] | None = None,
              src: Sources | None = None, costs: pd.DataFrame | None = None) -> TrainResult:
    """Train cfg.plan; decisions and the ETA's costs: None: cfg.results', else measured."""
    cfg, began = cfg or TrainConfig.default(), time.perf_counter()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(cfg.out_dir or f"train/{stamp}")
    stored = check(out, cfg.identity(), cfg.resume)  # before the source is read: writes nothing
    if stored and "finished" in stored:  # its summary and losses as it left them
        row = stored["finished"] | {"resumed_from_step": stored["finished"]["steps"]}
        say(f"diag train: the run in {out} finished at step {row['steps']}: nothing to train, "
            "its adapter is there (name a new --out-dir to train again)")
        history = json.loads((last_checkpoint(out) / "trainer_state.json").read_text())
        losses = _losses(history["log_history"], stored["eval_loss_0"],
                         row["real_tokens"] / row["steps_per_epoch"])
        return TrainResult(pd.DataFrame([row]), pd.DataFrame(), losses.assign(run=row["plan"]),
                           pd.DataFrame(), pd.DataFrame())
    if decisions is None and cfg.results and not stored:
        decisions = read_results(cfg.job())
    if costs is None and cfg.results:
        costs = costs_in(cfg.results, cfg.plan)
    preflight(cfg, cfg.job())  # folders, model, source and its first records: before torch
    if stored is None:
        record(out, cfg.identity(), fresh=True)
    return _start(cfg, out, stored or {}, decisions, src, costs, began)


@on_cpu_threads
def _start(cfg: TrainConfig, out: Path, stored: dict[str, Any],
           decisions: Iterable[Decision] | None, src: Sources | None,
           costs: pd.DataFrame | None, began: float) -> TrainResult:
    """The plan decided (a resume's: the one its run started with), priced, then run."""
    job, name, build = cfg.job(), cfg.plan, None
    with contextlib.nullcontext(src) if src else open_sources(job) as src:
        start = time.perf_counter()
        if "decisions" in stored:
            name, decisions = stored["plan"], read(pd.DataFrame({"json": stored["decisions"]}))
        elif decisions is None:
            inputs = job_inputs(job, src)
            decisions = measure_on_job(job, inputs)
            cache = job_records(job, inputs.data_path, inputs.model_dir).cache  # a hit
            build = (read_meta(cache.folder) or {}).get("build")
        decided = tuple(decisions)
        plan = Plan.naive() if name == "naive" else Plan.optimized(decided)
        plan_s = time.perf_counter() - start  # deciding it: the sweeps on the job, if measured
        record(out, {"plan": plan.name, "decisions": list(decisions_frame(decided)["json"])})
        if costs is None:
            costs = from_decisions(plan.name, plan.settings(), decided, build)
        gc.collect()  # the sweeps' models (reference cycles) go before the start freezes the rest
        with frozen_heap():  # as diag qlora's starts: the Trainer's collection is not its set-up
            return _run(cfg, plan, src, out, costs, stored, plan_s, began)


SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def _run(cfg: TrainConfig, plan: Plan, src: Sources, out: Path, costs: pd.DataFrame,
         stored: dict[str, Any], plan_s: float, began: float) -> TrainResult:
    """The timed run: its stages, the ETA, the held-out loss (step 0, on cadence), the adapter."""
    device = resolve(cfg.device)
    plan = plan.for_device(str(device))
    timer = StageTimer(device=device)  # on CUDA every stage boundary is a sync point
    work = scratch_folder("diag-train")  # a killed run's is swept next time
    try:
        with timer.stage("fetch_data"):
            path = fetch_data(plan, src, work)[0]
        if not cfg.records:  # a source too small for the eval split: refused before the load
            cfg.held_out(count_records(path, at_most=cfg.enough()))
        with timer.stage("load_model"):
            folder = model_folder(plan, src, work)
            model = load_model(cfg, plan, folder, device)
        with timer.stage("preprocess"):
            job = _job(cfg, plan, path, folder, work, model.config._attn_implementation)
        key = job.split.train.cache.key  # a resume trains on its run's records, never mixed
        if stored.get("cache") not in (None, key):
            raise ValueError(f"--resume: the source changed since the run in {str(out)!r} started "
                             f"(token cache {stored['cache'][:12]} then, {key[:12]} now): its "
                             "data position points into other records; name a new --out-dir")
        record(out, {"cache": key})
        plan = plan.fit(job.data.micro_batch * job.data.grad_accum)
        resume = last_checkpoint(out) if cfg.resume else None
        done = int(resume.name.split("-")[1]) if resume else 0
        projected = price(costs, _counts(cfg, job, done))
        split = job.split
        head = (f"diag train: the {plan.name} plan on {len(split.train.indices):,} records "
                f"({len(split.eval.indices):,} held out for eval"
                + (f", {split.dropped} past the last whole step" if split.dropped else "")
                + f"), {job.steps:,} optimizer steps of {cfg.batch_size} records "
                f"({job.steps / split.steps_per_epoch:.3g} epochs, "
                f"~{job.tokens_per_step * job.steps:,.0f} trained tokens); token cache "
                f"{split.train.cache.status}")
        say(before_line(head, projected, time.perf_counter() - began,
                        ("fetch_data", "load_model", "preprocess")))
        progress = progress_callback()(
            timer, job.tokens_per_step, cfg.cadence(cfg.progress_every, job.steps),
            f"diag train ({plan.name})", dict(zip(projected["stage"], projected["seconds"])),
            began)
        trainer, callback = trainer_for(
            cfg, plan, model, job.data, out, device, timer, callbacks=(progress,),
            save_total_limit=cfg.keep_checkpoints, eval_dataset=job.evals, max_steps=job.steps,
            lr_scheduler_type=SCHEDULES[cfg.lr_schedule],
            warmup_steps=round(cfg.lr_warmup * job.steps), eval_strategy="steps",
            eval_steps=cfg.eval_cadence(job.steps, len(job.split.eval.indices)),
            per_device_eval_batch_size=cfg.eval_batch, prediction_loss_only=True,
            save_steps=cfg.cadence(cfg.checkpoint_every, job.steps))
        first = stored.get("eval_loss_0")
        if resume is None:  # the held-out loss before the first step
            begin = time.perf_counter()
            with timer.stage("eval"):
                first = trainer.evaluate()["eval_loss"]
            callback.setup_from += time.perf_counter() - begin  # `setup`: the Trainer's, not this
            record(out, {"eval_loss_0": first})
        state = json.loads((resume / "trainer_state.json").read_text()) if resume else {}
        if state and state["global_step"] >= state.get("max_steps", float("inf")):
            from transformers import TrainerState  # trained to the end, stopped before its output:

            # nothing to train (the Trainer resumed there would add a step)
            trainer.state = TrainerState.load_from_json(str(resume / "trainer_state.json"))
            trainer._load_from_checkpoint(str(resume))
            wall = 0.0
        else:
            wall = fit(trainer, callback, resume, out)
        with timer.stage("checkpoint"):  # the output: adapter + tokenizer, whole
            files = publish(out, lambda tmp: _save_output(trainer, folder, src, tmp))
            made = merged(folder, out, out / "merged") if cfg.merge else None
        stages = timer.to_frame().assign(run=f"train ({plan.name})")  # beside a comparison's
        eta = check_eta(projected, stages)
        losses = _losses(trainer.state.log_history, first, job.tokens_per_step)
        command_s = time.perf_counter() - began
        frame = pd.DataFrame([_summary(cfg, plan, job, trainer, done, wall, eta, losses, out,
                                       files, made) | {"plan_s": plan_s, "command_s": command_s,
                                                       "eta_s": progress.promised}])
        record(out, {"finished": json.loads(frame.to_json(orient="records"))[0]})
        kept = (f"; the whole command {duration(command_s)} against its ETA of "
                f"{duration(progress.promised)} ({command_s / progress.promised - 1:+.0%})"
                if progress.promised else "")
        say(f"diag train: the run {after_line(eta)}{kept}; the adapter is in {out}")
        return TrainResult(frame, stages, losses.assign(run=plan.name), eta, plan.frame())
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class _Job:
    """What the preprocess stage made: the records, the plan's datasets, the run's steps."""

    split: Split
    data: Data
    evals: Any  # the held-out records, one a row (PackedDataset, pack=False)
    steps: int  # optimizer steps of the run (epochs x steps per epoch, or max_steps)
    tokens_per_step: float  # trained tokens per optimizer step: an epoch's, spread evenly


def _job(cfg: TrainConfig, plan: Plan, path: Path, folder: Path, work: Path,
         attention: str | None) -> _Job:
    """The preprocess stage: the whole token cache, the held-out split, the plan's datasets."""
    from diag.data import PackedDataset

    split = train_records(cfg, path, folder)
    rows = ArrowRecords(path, cfg.fields(), work, split.train.indices) \
        if plan.pipeline == "naive" else None
    data = build_dataset(cfg, plan, split.train, folder, path, attention,
                         steps=split.steps_per_epoch, rows=rows)
    evals = PackedDataset(split.eval.cache.folder, cfg.seq_len, records=split.eval.indices,
                          pack=False)  # one record a row, in both plans: their losses compare
    return _Job(split, data, evals, cfg.total_steps(split.steps_per_epoch),
                data.stats["real_tokens"] / split.steps_per_epoch)


def _save_output(trainer: Any, folder: Path, src: Sources, tmp: Path) -> None:
    """The adapter as PEFT saves it, its base named as given (never diag's cache); the tokenizer."""
    from transformers import AutoTokenizer

    for config in trainer.model.peft_config.values():
        config.base_model_name_or_path = src.model
        config.revision = None if Path(src.model).is_dir() else src.revision
    base = trainer.model.get_base_model()  # what the README's model card names
    base.config.name_or_path = base.name_or_path = src.model
    # LoRA on the projections alone: no embedding to save, so no hub look-up of the base's
    trainer.model.save_pretrained(tmp, save_embedding_layers=False)
    with open(tmp / "README.md", "a", encoding="utf-8") as card:
        card.write(PACKED_ROWS)
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp)


def _losses(history: list[dict[str, Any]], first_eval: float, tokens_per_step: float
            ) -> pd.DataFrame:
    """Each step's train loss and each eval's (step 0: before training), with trained tokens."""
    rows = [{"split": "eval", "step": 0, "loss": first_eval, "learning_rate": None}]
    rows += [{"split": "train", "step": h["step"], "loss": h["loss"],
              "learning_rate": h.get("learning_rate")} for h in history if "loss" in h]
    rows += [{"split": "eval", "step": h["step"], "loss": h["eval_loss"], "learning_rate": None}
             for h in history if "eval_loss" in h]
    frame = pd.DataFrame(rows)
    return frame.assign(trained_tokens=(frame["step"] * tokens_per_step).round().astype(int))


def _counts(cfg: TrainConfig, job: _Job, done: int) -> dict[str, float]:
    """What the run does after step `done`, counted before its first step (eta.job_counts)."""
    cache = job.split.train.cache
    return job_counts(
        job.steps, cfg.warmup_steps, job.tokens_per_step,
        job.data.stats["token_slots"] / job.split.steps_per_epoch,
        cfg.eval_cadence(job.steps, len(job.split.eval.indices)),
        cfg.cadence(cfg.checkpoint_every, job.steps),
        len(job.split.eval.indices) * cfg.seq_len, done,
        0 if cache.status == "hit" else read_meta(cache.folder)["build"]["bytes"],
        max(job.split.train.indices, default=-1) + 1)


def _summary(cfg: TrainConfig, plan: Plan, job: _Job, trainer: Any, done: int, wall: float,
             eta: pd.DataFrame, losses: pd.DataFrame, out: Path, files: list[str],
             made: Path | None) -> dict[str, Any]:
    total, split = eta.set_index("stage").loc["total"], job.split
    evals = losses.loc[losses["split"] == "eval", "loss"]
    return {**job.data.stats, "plan": plan.name, "records": len(split.train.indices),
            "eval_records": len(split.eval.indices), "dropped_records": split.dropped,
            "steps": trainer.state.global_step, "steps_per_epoch": split.steps_per_epoch,
            "epochs": job.steps / split.steps_per_epoch, "batch_size": cfg.batch_size,
            "resumed_from_step": done,
            "trained_tokens": round(job.tokens_per_step * trainer.state.global_step),
            "seconds": total.measured_s, "predicted_s": total.predicted_s,
            "eta_error": total.error_share, "trainer_wall_s": wall,
            "micro_batch": trainer.args.per_device_train_batch_size,
            "grad_accum": trainer.args.gradient_accumulation_steps,
            **{k: getattr(plan, k) for k in ("num_workers", "pipeline", "gradient_checkpointing")},
            "first_eval_loss": float(evals.iloc[0]), "final_eval_loss": float(evals.iloc[-1]),
            "final_loss": float(losses.loc[losses["split"] == "train", "loss"].iloc[-1]),
            "out_dir": str(out.resolve()), "output": " ".join(files),
            "merged": str(made) if made else "", "notes": " ".join(plan.notes)}
