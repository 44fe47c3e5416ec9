"""The decisions of the optimized plan, measured on the QLoRA job's own step on this machine.

`plan_from_job(cfg)` is what run_qlora calls: the job's inputs (`job_inputs`: the landed data,
the cached model, its rows per optimizer step), then, unless decisions are given or cfg.results
names a run folder, the three measurements on the job: `accum_on_job` (micro-batch x grad-accum
of the nf4 + LoRA model at the job's seq_len and rows per step, the candidates the divisors the
job can run), `diag.qlora.checkpointing.measure` (on vs off at the chosen micro-batch) and
`loader_on_job` (diag.loader's sweep consuming `QLoraStep`). Each returns its experiment's
result with its decisions; the plan only collects them, then fits the micro-batch to the job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.decision import Decision, MeasuredOn

if TYPE_CHECKING:
    import pandas as pd

    from diag.accum import AccumResult
    from diag.config import QLoraConfig
    from diag.loader import LoaderResult
    from diag.qlora.checkpointing import CheckpointingResult
    from diag.qlora.job import Sources
    from diag.qlora.plans import Plan

# Result frames a run folder holds, by the CSV names report.write gives them.
RESULT_FILES = {"storage": ("storage",), "model_load": ("model_load",),
                "loader": ("loader", "workers"), "accum": ("accum_summary", "accum"),
                "checkpointing": ("checkpointing",)}


class QLoraStep:
    """One optimizer step of the job's model (nf4 base, LoRA adapters), as the Trainer takes it:
    forward, backward, AdamW on the adapters; a loader sweep's consumer."""

    def __init__(self, cfg: QLoraConfig, model_dir: Any, device: Any,
                 gradient_checkpointing: bool = False) -> None:
        import dataclasses

        import torch

        from diag.machine.device import sync
        from diag.qlora.job import load_model
        from diag.qlora.plans import Plan

        plan = dataclasses.replace(Plan.naive(), gradient_checkpointing=gradient_checkpointing)
        self.device, self._sync = device, sync
        self.model = load_model(cfg, plan, model_dir, device)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr)

    def backward(self, batch: dict[str, Any], scale: float = 1.0) -> None:
        """One micro-batch: forward and backward (gradients accumulate until update)."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        (self.model(**batch).loss * scale).backward()

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync(self.device)  # note: sync point, so the step's kernels are billed to the step

    def __call__(self, batch: dict[str, Any]) -> None:
        self.backward(batch)
        self.update()


@dataclass(frozen=True)
class JobInputs:
    """What the measurements on the job need: the landed data, the cached model, the device, the
    rows per optimizer step the packed job runs (micro_batch x grad_accum must equal it)."""

    rows_per_step: int
    model_dir: Path
    data_path: Path
    device: Any


def job_label(cfg: QLoraConfig) -> str:
    return f"{cfg.model or 'the embedded tiny Llama'} + LoRA r={cfg.lora_r}"


def job_inputs(cfg: QLoraConfig, src: Sources | None = None) -> JobInputs:
    """Land the data, fill the persistent model cache, build the packed dataset once (the token
    cache every optimized start reuses) and read its rows per step off it. src: sources already
    open (run_qlora's, which its runs then use); else they are opened and closed here."""
    import contextlib
    import dataclasses
    import shutil
    import tempfile

    from diag.machine.device import resolve
    from diag.qlora.data import build_dataset, check_records, read
    from diag.qlora.job import fetch_data, model_folder, open_sources
    from diag.qlora.plans import Plan

    plan = dataclasses.replace(Plan.naive(), fetch="land", model_cache="persistent",
                               pipeline="packed")
    work = Path(tempfile.mkdtemp(prefix="diag-qlora-measure-"))
    try:
        with contextlib.nullcontext(src) if src else open_sources(cfg) as src:
            path, folder = fetch_data(plan, src, work), model_folder(plan, src, work)
        records, bad = read(cfg, path)
        data = build_dataset(cfg, plan, check_records(cfg, records, folder, bad), folder, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return JobInputs(data.micro_batch * data.grad_accum, folder, path, resolve(cfg.device))


def micro_candidates(rows_per_step: int, most: int = 4) -> list[int]:
    """Micro-batches the job can run (divisors of its rows per step): 1, the largest, and
    between them up to `most` spread evenly in log scale."""
    divisors = [d for d in range(1, rows_per_step + 1) if rows_per_step % d == 0]
    if len(divisors) <= most:
        return divisors
    picks = {divisors[round(i * (len(divisors) - 1) / (most - 1))] for i in range(most)}
    return sorted(picks)


def accum_on_job(cfg: QLoraConfig, job: JobInputs, micro_batches: list[int] | None = None
                 ) -> AccumResult:
    """micro_batch x grad_accum == the job's rows per step, on the job's model (checkpointing
    off: its own measurement prices it), a one-micro-batch warm-up then cfg.sweep_steps timed
    optimizer steps; one row
    per timed step in diag.accum's columns, summarized and decided by diag.accum."""
    import time

    import pandas as pd
    import torch

    from diag.accum import COLUMNS, AccumResult, PeakMemory, advice, decide, is_oom, summarize

    rows_per_step, seq = job.rows_per_step, cfg.seq_len
    micro_batches = micro_batches or cfg.sweep_micro_batches or micro_candidates(rows_per_step)
    bad = [m for m in micro_batches if rows_per_step % m]
    if bad:
        raise ValueError(f"QLoraConfig.sweep_micro_batches={bad}: must divide the job's "
                         f"{rows_per_step} rows per step; allowed: "
                         + ", ".join(map(str, micro_candidates(rows_per_step, rows_per_step))))
    step = QLoraStep(cfg, job.model_dir, job.device)
    vocab = step.model.config.vocab_size
    gen = torch.Generator().manual_seed(cfg.seed)
    memory, rows = PeakMemory(job.device), []
    tokens = rows_per_step * seq
    for micro in micro_batches:
        accum = rows_per_step // micro
        ids = torch.randint(4, vocab, (micro, seq), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        base = {"micro_batch": micro, "grad_accum": accum, "tokens_per_step": tokens,
                "floor_s": math.nan, "flops_per_token": math.nan, "mfu": math.nan,
                "compile": False, "detail": job_label(cfg)}
        try:
            # warm-up: one micro-batch and an update (allocator and kernels for this shape);
            # the timed steps accumulate the job's whole step
            start = time.perf_counter()
            step.backward(batch, 1.0 / accum)
            step.update()
            warm = time.perf_counter() - start
            for i in range(1, cfg.sweep_steps + 1):
                memory.reset()
                start = time.perf_counter()
                for _ in range(accum):
                    step.backward(batch, 1.0 / accum)
                step.update()
                seconds = time.perf_counter() - start
                rows.append({**base, "seconds_per_step": seconds, "tokens_per_s": tokens / seconds,
                             "data_s": 0.0, "compute_s": seconds,
                             "peak_mem_gb": memory.growth_gb(), "status": "ok", "repeat": i - 1,
                             "warmup_s": warm})
        except Exception as err:  # an OOM is a measured point, anything else raises
            if not is_oom(err):
                raise
            step.optimizer.zero_grad(set_to_none=True)
            rows.append({**base, "status": "oom", "repeat": 0, "peak_mem_gb": memory.gb()})
    frame = pd.DataFrame(rows, columns=COLUMNS)
    summary = summarize(frame)
    on = MeasuredOn(model=job_label(cfg), precision="nf4", seq_len=seq,
                    step=f"the QLoRA step, {rows_per_step} rows per optimizer step "
                         "(checkpointing off)", device=str(job.device))
    mfu = pd.DataFrame()  # the QLoRA MFU is diag.qlora's own (formula vs FlopCounterMode)
    return AccumResult(frame, summary, mfu, advice(summary, cfg.steps), decide(summary, on))


def loader_on_job(cfg: QLoraConfig, job: JobInputs, micro: int) -> LoaderResult:
    """diag.loader's sweep with the job's step as the consumer (its data, its tokenizer, its
    seq_len, the chosen micro-batch, cfg.sweep_workers); the stall split waits as long as that
    step measured, the profile is the naive pipeline's."""
    from diag.config import LoaderConfig
    from diag.loader import run_loader

    step = QLoraStep(cfg, job.model_dir, job.device)
    label = f"the QLoRA step, micro-batch {micro} x {cfg.seq_len} tokens"
    loader_cfg = LoaderConfig.default(
        quick=True, device=cfg.device, consumer="model", data=str(job.data_path),
        tokenizer=str(job.model_dir), batch_size=micro, seq_len=cfg.seq_len,
        workers=list(cfg.sweep_workers), steps=max(2, cfg.sweep_steps * 2), repeats=1,
        run_steps=cfg.steps)
    on = MeasuredOn(model=job_label(cfg), precision="nf4", seq_len=cfg.seq_len, step=label,
                    device=str(job.device))
    return run_loader(loader_cfg, step=(step, float("nan"), label), measured_on=on,
                      emulate_stalls=True)


def checkpointing_on_job(cfg: QLoraConfig, job: JobInputs, micro: int) -> CheckpointingResult:
    """Checkpointing on vs off on the job's step at `micro` (diag.qlora.checkpointing): they
    alternate step by step, so a load change on a shared machine hits both."""
    import time

    import pandas as pd
    import torch

    from diag.accum import PeakMemory
    from diag.qlora.checkpointing import COLUMNS, CheckpointingResult, decide
    from diag.qlora.plans import Plan

    device, steps = job.device, cfg.sweep_steps

    gen = torch.Generator().manual_seed(cfg.seed)
    runs = {on: QLoraStep(cfg, job.model_dir, device, gradient_checkpointing=on)
            for on in (True, False)}
    vocab = runs[True].model.config.vocab_size
    memory, rows = PeakMemory(device), []
    # at the plan's micro-batch (the decision), and at the naive plan's: the naive step's own
    # on/off ratio (recomputing activations costs a different share at another micro-batch)
    for m in sorted({Plan.naive().micro_batch, micro}):
        ids = torch.randint(4, vocab, (m, cfg.seq_len), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        for i in range(steps + 1):
            for on, step in runs.items():
                memory.reset()
                start = time.perf_counter()
                step(batch)
                seconds = time.perf_counter() - start
                if i:  # the first step pays allocator growth and kernel choice
                    rows.append({"gradient_checkpointing": on, "micro_batch": m,
                                 "seq_len": cfg.seq_len, "seconds": seconds,
                                 "peak_mem_gb": memory.growth_gb(), "repeat": i - 1})
    frame = pd.DataFrame(rows, columns=COLUMNS)
    on = MeasuredOn(model=job_label(cfg), precision="nf4", seq_len=cfg.seq_len,
                    step=f"the QLoRA step, micro-batch {micro}", device=str(device))
    return CheckpointingResult(frame, decide(frame, str(device), on))


def measure_on_job(cfg: QLoraConfig, job: JobInputs | None = None) -> dict[str, Any]:
    """The three measurements in order (accum picks the micro-batch the others run at): results
    by experiment (accum, checkpointing, loader), each with its decisions."""
    from diag.decision import by_setting

    job = job or job_inputs(cfg)
    accum = accum_on_job(cfg, job)
    micro = by_setting(accum.decisions)["micro_batch"].value
    ckpt = checkpointing_on_job(cfg, job, micro)
    return {"accum": accum, "checkpointing": ckpt, "loader": loader_on_job(cfg, job, micro)}


def decisions_from_job(cfg: QLoraConfig, job: JobInputs | None = None) -> tuple[Decision, ...]:
    return tuple(d for r in measure_on_job(cfg, job).values() for d in r.decisions)


def plan_from_job(cfg: QLoraConfig, decisions: Iterable[Decision] | Mapping[str, Any] | None
                  = None, src: Sources | None = None) -> Plan:
    """The optimized plan run_qlora runs: the given decisions (or frames), else cfg.results'
    (checked against this job), else measured on the job; fitted to the job's rows per step.
    src: open sources to read the job's inputs from (job_inputs)."""
    from diag.qlora.plans import Plan

    if decisions is None and cfg.results:  # checked before anything is measured or run
        decisions = load_results(cfg.results, cfg)
    job = job_inputs(cfg, src)
    if decisions is None:
        decisions = decisions_from_job(cfg, job)
    return Plan.optimized(decisions, device=str(job.device)).fit(job.rows_per_step)


def load_results(folder: str | Path, cfg: QLoraConfig | None = None) -> tuple[Decision, ...]:
    """The decisions a run folder's CSVs give, by each experiment's own rule. Its decisions.csv
    must name this job's model and seq_len (else ValueError, one line naming both)."""
    import pandas as pd

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"QLoraConfig.results={str(folder)!r}: no such run folder")
    if cfg is not None and (folder / "decisions.csv").is_file():
        _check_job(pd.read_csv(folder / "decisions.csv"), folder, cfg)
    found: dict[str, pd.DataFrame] = {}
    for key, names in RESULT_FILES.items():
        name = next((n for n in names if (folder / f"{n}.csv").is_file()), None)
        if name is not None:
            found[key] = pd.read_csv(folder / f"{name}.csv")
    from diag.machine.device import resolve
    from diag.qlora.plans import decide_frames

    return decide_frames(found, str(resolve(cfg.device)) if cfg else "cpu")


def _check_job(table: pd.DataFrame, folder: Path, cfg: QLoraConfig) -> None:
    measured = table[~table["basis"].isin(["default", "projected"])]  # what was measured here
    for column, want in (("model", job_label(cfg)), ("seq_len", cfg.seq_len)):
        if column not in measured.columns:
            continue
        got = {v for v in measured[column].dropna() if str(v) not in ("", "nan")}
        other = sorted(str(v) for v in got if str(v) != str(want) and
                       not (column == "seq_len" and float(v) == float(want)))
        if other:
            raise ValueError(f"QLoraConfig.results={str(folder)!r} was measured on {column} "
                             f"{', '.join(other)}, this job runs {want}: no plan is built from it")


measure_results = measure_on_job  # the former name (bench/qlora.py), kept while callers move
