"""The optimized plan's decisions, measured on the QLoRA job's own step on this machine (`OnJob`:
micro-batch, checkpointing, loader, in one order with one budget), or read back from a run."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from diag.config import LoaderConfig
from diag.decision import Decision, MeasuredOn, read
from diag.machine.device import resolve, sync
from diag.noise import MIN_SAMPLES, unresolved
from diag.qlora import checkpointing
from diag.qlora.base import load_model
from diag.qlora.job import open_sources, prepare
from diag.qlora.plans import Plan

if TYPE_CHECKING:
    from diag.accum import AccumResult
    from diag.config import QLoraConfig
    from diag.loader import LoaderResult
    from diag.qlora.job import Sources


class QLoraStep:
    """The job's optimizer step as the Trainer takes it; rows None: random batches of its shape."""

    def __init__(self, cfg: QLoraConfig, model_dir: Any, device: Any,
                 gradient_checkpointing: bool = False, model: Any = None,
                 rows: list[dict[str, Any]] | None = None) -> None:
        import torch
        from peft import get_peft_model_state_dict

        plan = dataclasses.replace(Plan.naive(), gradient_checkpointing=gradient_checkpointing)
        self.device, self._lr, self._seq_len, self._rows = device, cfg.lr, cfg.seq_len, rows
        self.model = model if model is not None else load_model(cfg, plan, model_dir, device)
        self.model.train()
        self._initial = {k: v.to("cpu", copy=True)  # the adapters' starting weights
                         for k, v in get_peft_model_state_dict(self.model).items()}
        self._gen = torch.Generator().manual_seed(cfg.seed)  # each step: the same batches
        self.reset()

    def batches(self, micro_batch: int) -> contextlib.AbstractContextManager[Iterator[Any]]:
        """The rows collated as the Trainer does, else one random batch of the job's shape."""
        import torch
        from transformers import default_data_collator  # the Trainer's, given no tokenizer

        if self._rows is not None:
            return contextlib.nullcontext(itertools.cycle(
                [default_data_collator(self._rows[i:i + micro_batch])
                 for i in range(0, len(self._rows), micro_batch)]))
        ids = torch.randint(4, self.model.config.vocab_size, (micro_batch, self._seq_len),
                            generator=self._gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        return contextlib.nullcontext(itertools.repeat(batch))

    def reset(self) -> None:
        import torch
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, self._initial)
        self.model.zero_grad(set_to_none=True)
        self.optimizer = None  # the last point's state goes before this point allocates
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self._lr)

    def backward(self, batch: dict[str, Any], scale: float = 1.0) -> None:
        """One micro-batch: forward and backward (gradients accumulate until update)."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        (self.model(**batch).loss * scale).backward()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # one process: nothing to all-reduce

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def __call__(self, batch: dict[str, Any]) -> None:
        self.backward(batch)
        self.update()
        sync(self.device)  # note: sync point, so the step's kernels are billed to the step


class OnJob:
    """The job's decisions in one order and budget; share(name): past it accum cuts its screen."""

    def __init__(self, cfg: QLoraConfig, job: JobInputs,
                 share: Callable[[str], float] | None = None) -> None:
        self.cfg, self.job, self.left, self.share = cfg, job, cfg.decide_budget_s, share
        self._made = functools.cache(lambda ckpt: QLoraStep(cfg, job.model_dir, job.device, ckpt))

    def step(self, gradient_checkpointing: bool = False) -> QLoraStep:
        """The job's step, loaded once per setting, handed out reset."""
        step = self._made(gradient_checkpointing)
        step.reset()
        return step

    def accum(self) -> AccumResult:
        got = accum_on_job(self.cfg, self.job, budget_s=self.left / 2, on=self,
                           share_s=self.share("accum") if self.share else None)
        self.left -= got.decisions[0].repeats_s or 0.0
        return got

    def checkpointing(self, micro: int) -> checkpointing.CheckpointingResult:
        got = checkpointing_on_job(self.cfg, self.job, micro, max(0.0, self.left), on=self)
        self.left -= got.decisions[0].repeats_s or 0.0
        return got

    def loader(self, micro: int) -> LoaderResult:
        """diag.loader's sweep over the job's records with the job's step at `micro` as consumer."""
        from diag.loader import run_loader

        cfg, job = self.cfg, self.job
        label = f"the QLoRA step, micro-batch {micro} x {cfg.seq_len} tokens"
        loader_cfg = LoaderConfig.default(
            quick=True, device=cfg.device, consumer="model", data=str(job.data_path),
            **cfg.source_kwargs(LoaderConfig),  # the job's records, read with its fields
            tokenizer=str(job.model_dir), batch_size=micro, seq_len=cfg.seq_len,
            # MIN_SAMPLES repeats of a short epoch each: the decision compares their waits
            workers=list(cfg.sweep_workers), steps=2, repeats=max(MIN_SAMPLES, cfg.sweep_steps),
            run_steps=cfg.steps)
        return run_loader(loader_cfg, step=(self.step(), float("nan"), label),
                          measured_on=_on(cfg, job, label), emulate_stalls=True)

    def close(self) -> None:
        self._made.cache_clear()


@dataclass(frozen=True)
class JobInputs:
    """What the measurements on the job need; rows_per_step: the packed job's per optimizer step."""

    rows_per_step: int
    model_dir: Path
    data_path: Path
    device: Any


def job_label(cfg: QLoraConfig) -> str:
    return f"{cfg.model or 'the embedded tiny Llama'} + LoRA r={cfg.lora_r}"


def _on(cfg: QLoraConfig, job: JobInputs, step: str, **more: Any) -> MeasuredOn:
    return MeasuredOn(model=job_label(cfg), precision="nf4", seq_len=cfg.seq_len, step=step,
                      device=str(job.device), **more)


def job_inputs(cfg: QLoraConfig, src: Sources | None = None) -> JobInputs:
    """Land the data, fill the model and token caches, read the packed job's rows per step."""
    plan = dataclasses.replace(Plan.naive(), fetch="land", model_cache="persistent",
                               pipeline="packed")
    with contextlib.nullcontext(src) if src else open_sources(cfg) as src:
        path, folder, data = prepare(cfg, plan, src)
    return JobInputs(data.micro_batch * data.grad_accum, folder, path, resolve(cfg.device))


def micro_candidates(rows_per_step: int, most: int = 4) -> list[int]:
    """Up to `most` divisors of rows_per_step, 1 and the largest among them, evenly spread."""
    divisors = [d for d in range(1, rows_per_step + 1) if rows_per_step % d == 0]
    if len(divisors) <= most:
        return divisors
    picks = {divisors[round(i * (len(divisors) - 1) / (most - 1))] for i in range(most)}
    return sorted(picks)


def accum_on_job(cfg: QLoraConfig, job: JobInputs, micro_batches: list[int] | None = None,
                 budget_s: float | None = None, on: OnJob | None = None,
                 share_s: float | None = None) -> AccumResult:
    """micro x accum at the job's rows per step, screened then re-timed within budget_s."""
    from diag.accum import AccumResult, accum_frame, advice, decide, retime, summarize, train_points

    rows_per_step = job.rows_per_step
    micro_batches = micro_batches or cfg.sweep_micro_batches or micro_candidates(rows_per_step)
    if bad := [m for m in micro_batches if rows_per_step % m]:
        raise ValueError(f"{type(cfg).__name__}.sweep_micro_batches={bad}: must divide the job's "
                         f"{rows_per_step} rows per step; allowed: "
                         + ", ".join(map(str, micro_candidates(rows_per_step, rows_per_step))))
    one = [(on or OnJob(cfg, job)).step()]
    # a step each, then interleaved rounds: a point's steps in a row let a moving load decide
    start, frames, cut = time.perf_counter(), [], []
    for i, m in enumerate(micro_batches):
        if share_s is not None and i >= 2 and time.perf_counter() - start > share_s:
            cut = micro_batches[i:]
            break
        frames.append(train_points(one, [(m, rows_per_step // m)], repeats=1, warmup_steps=1,
                                   desc="accum sweep on the job"))
    left = cfg.decide_budget_s / 2 if budget_s is None else budget_s
    if share_s is not None:
        left = max(0.0, min(left, share_s - (time.perf_counter() - start)))
    timed, spent = retime(one, pd.concat(frames, ignore_index=True), unresolved, budget_s=left,
                          at_least=cfg.sweep_steps)
    tokens = rows_per_step * cfg.seq_len
    # no floor or MFU here: the QLoRA step's FLOPs are diag.mfu's
    frame = accum_frame(timed, tokens, detail=job_label(cfg))
    summary = summarize(frame, device=str(job.device))
    where = _on(cfg, job, f"the QLoRA step, {rows_per_step} rows per optimizer step "
                       "(checkpointing off)", tokens_per_step=tokens)
    (decided,) = decide(frame, where, repeats_s=spent)
    if cut:
        decided = dataclasses.replace(decided, why=f"{decided.why}; micro-batch "
                                      f"{', '.join(map(str, cut))} not timed: the step's share "
                                      f"of the budget ({share_s:.3g} s) ran out")
    return AccumResult(frame, summary, pd.DataFrame(), advice(summary, cfg.steps), (decided,))


def checkpointing_on_job(cfg: QLoraConfig, job: JobInputs, micro: int,
                         budget_s: float | None = None, on: OnJob | None = None
                         ) -> checkpointing.CheckpointingResult:
    """Checkpointing on vs off at `micro` and the naive micro-batch, until checkpointing.pending."""
    from diag.accum import retime, train_points

    naive = Plan.naive().micro_batch
    pool = on or OnJob(cfg, job)
    pair = [pool.step(ckpt) for ckpt in (True, False)]
    timed = train_points(pair, [(m, 1) for m in sorted({naive, micro})], repeats=1,
                         warmup_steps=1, desc="checkpointing on/off")
    budget_s = cfg.decide_budget_s / 2 if budget_s is None else budget_s
    timed, spent = retime(pair, timed, checkpointing.pending, budget_s=budget_s,
                          at_least=cfg.sweep_steps)
    ok = timed[timed["status"] == "ok"]
    frame = pd.DataFrame({"gradient_checkpointing": ok["step"] == 0,
                          "micro_batch": ok["micro_batch"], "seq_len": cfg.seq_len,
                          "seconds": ok["seconds_per_step"], "cpu_s": ok["cpu_s"],
                          "peak_mem_gb": ok["peak_mem_gb"], "repeat": ok["repeat"]},
                         columns=checkpointing.COLUMNS).reset_index(drop=True)
    where = _on(cfg, job, f"the QLoRA step, micro-batch {micro}")
    return checkpointing.CheckpointingResult(frame, checkpointing.decide(
        frame, str(job.device), where, naive_micro_batch=naive, repeats_s=spent))


def measure_on_job(cfg: QLoraConfig, job: JobInputs) -> tuple[Decision, ...]:
    """The job's decisions in their one order, with one budget split (OnJob)."""
    on = OnJob(cfg, job)
    try:
        accum = on.accum()
        (micro,) = (d.value for d in accum.decisions)  # diag.accum decides micro_batch alone
        return (*accum.decisions, *on.checkpointing(micro).decisions, *on.loader(micro).decisions)
    finally:
        on.close()


def plan_from_job(cfg: QLoraConfig, decisions: Iterable[Decision] | None = None,
                  src: Sources | None = None) -> Plan:
    """The optimized plan of the decisions (None: measured on the job), fitted to the job."""
    job = job_inputs(cfg, src)
    if decisions is None:
        decisions = measure_on_job(cfg, job)
    return Plan.optimized(decisions, device=str(job.device)).fit(job.rows_per_step)


def read_results(cfg: QLoraConfig) -> tuple[Decision, ...]:
    """The decisions cfg.results' decisions.csv kept, refused unless measured on this job."""
    table = Path(cfg.results) / "decisions.csv"
    if not table.is_file():
        raise ValueError(f"QLoraConfig.results={cfg.results!r}: no run folder with a "
                         "decisions.csv there")
    decisions = read(pd.read_csv(table))
    measured = [d.measured_on for d in decisions if d.basis not in ("default", "projected")
                and d.measured_on.seq_len]
    for name, want in (("model", job_label(cfg)), ("seq_len", cfg.seq_len)):
        other = sorted({str(v) for on in measured if (v := getattr(on, name)) not in ("", None)
                        and v != want})
        if other:
            raise ValueError(f"QLoraConfig.results={cfg.results!r} was measured on {name} "
                             f"{', '.join(other)}, this job runs {want}: no plan is built from it")
    return decisions
