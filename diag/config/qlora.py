"""`diag qlora` and `diag train`: the QLoRA job's configs (diag.qlora). `JobConfig` is what both
share; `QLoraConfig` is the side-by-side comparison, `TrainConfig` the whole-dataset run."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from diag.config.base import number, whole
from diag.config.source import SourceConfig

QLoraPlan = Literal["naive", "optimized", "both"]
MEASURED_STEPS = 4  # optimizer steps of the job the plan is decided on
EVAL_SHARE = 0.1  # the default eval cadence keeps evals under this share of the training


@dataclass
class JobConfig(SourceConfig):
    """The QLoRA job (nf4 base + LoRA, transformers.Trainer) as both commands run it."""

    seq_len: int = 128  # token slots per row: naive pads each record to it, optimized packs into it
    on_error: str = "raise"  # a bad row or a prompt filling seq_len: "raise" stops, "skip" counts
    warmup_steps: int = 1  # first optimizer steps timed as `warmup`, apart from steady state
    lr: float = 2e-4  # peak learning rate (linear warm-up over 10% of steps, linear decay)
    seed: int = 0  # the same in both plans, so the loss curves compare
    lora_r: int = 16  # LoRA rank; higher adapts more and trains slower
    lora_alpha: int = 32  # LoRA scale numerator (scale = alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input
    checkpoint_every: int = 0  # save adapter + optimizer + data position every N steps; 0 = at end
    resume: bool = False  # continue from the last checkpoint in out_dir (none there: refused)
    out_dir: str = ""  # checkpoints; "" = a fresh temporary folder per run
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:N"; CUDA-only settings fall back on CPU
    results: str = ""  # run folder whose decisions.csv the optimized plan collects; "" = measure
    # the sweeps on the job's own step that decide the optimized plan
    sweep_micro_batches: list[int] = field(default_factory=list)  # [] = 4 divisors of the rows
    sweep_workers: list[int] = field(default_factory=lambda: [0, 1, 2])  # loader sweep's workers
    sweep_steps: int = 5  # timed steps per sweep point after a warm-up; 5: fewest a gap resolves
    decide_budget_s: float = 60.0  # seconds re-timing points left within noise (0: screen only)

    # what a resumed run must share with the run it continues
    IDENTITY: ClassVar[tuple[str, ...]] = (
        "source", "model", "revision", "text_field", "prompt_field", "response_field",
        "messages_field", "seq_len", "on_error", "lr", "seed", "lora_r", "lora_alpha",
        "lora_dropout")

    def identity(self) -> dict[str, Any]:
        """The settings a resume must share with the run it continues (IDENTITY)."""
        return {k: v for k, v in self.to_dict().items() if k in self.IDENTITY}

    def validate(self) -> None:
        super().validate()  # the source flags
        self._positive("seq_len", "lr", "lora_r", "lora_alpha", "sweep_steps")
        self._wholes("sweep_workers", 0)
        self._wholes("sweep_micro_batches", 1)
        self._check(("sweep_workers",), bool, "name at least one num_workers")
        self._non_negative("warmup_steps", "lora_dropout", "checkpoint_every", "seed")
        self._check(("decide_budget_s",), lambda v: number(v) and 0 <= v < float("inf"),
                    "must be a finite number of seconds >= 0")
        self._check(("lora_dropout",), lambda v: v < 1, "must be in [0, 1)")


@dataclass
class QLoraConfig(JobConfig):
    """`diag qlora`: the QLoRA fine-tune (nf4 + LoRA, Trainer), naive vs optimized plan: stages,
    loss curves, predicted vs measured saving per fix."""

    plan: QLoraPlan = "both"  # "naive" (a newcomer's defaults), "optimized" (the fixes) or both
    records: int = 128  # records both plans train on once (the same tokens)
    steps: int = 8  # optimizer steps both plans take over those records (same LR schedule)
    rounds: int = 3  # plans run interleaved this many times (order alternating); medians + spread
    slow_rank: int = -1  # under torchrun: its loader sleeps slow_ms more per batch; -1: none
    slow_ms: float = 0.0  # slow_rank's extra sleep per batch (a straggler on purpose), in ms

    IDENTITY: ClassVar[tuple[str, ...]] = (*JobConfig.IDENTITY, "plan", "records", "steps")
    QUICK: ClassVar[dict[str, Any]] = {"records": 12, "steps": 3, "seq_len": 96, "lora_r": 8,
                                       "lora_alpha": 16, "sweep_workers": [0, 2],
                                       "decide_budget_s": 20.0, "rounds": 1}
    # `diag run`: smaller sweeps, never fewer rounds (their spread says if the headline resolved)
    RUN: ClassVar[dict[str, Any]] = {"sweep_workers": [0, 2], "decide_budget_s": 30.0,
                                     "records": 32, "steps": 4, "rounds": 3}

    def validate(self) -> None:
        super().validate()
        self._positive("records", "steps")
        self._whole("rounds")
        self._check(("steps",), lambda v: v <= self.records, f"at most records={self.records} "
                    "(each optimizer step needs at least one record)")
        self._check(("warmup_steps",), lambda v: v < self.steps, f"must be below steps="
                    f"{self.steps}, so some steps are measured in steady state")


@dataclass
class TrainConfig(JobConfig):
    """`diag train`: the QLoRA fine-tune of the whole dataset under the optimized (or naive)
    plan: epochs, held-out eval, checkpoints and resume, an ETA checked after; the adapter (PEFT's
    format) and tokenizer in --out-dir."""

    lr: float = 2e-4  # peak learning rate: warmed up over lr_warmup, then lr_schedule
    checkpoint_every: int = 0  # save adapter, optimizer, RNG, data position every N steps; 0: 10x
    out_dir: str = ""  # the adapter, tokenizer and checkpoints; "" = train/<UTC timestamp>
    results: str = ""  # a run folder whose decisions and costs are used; "" = measure this job
    plan: Literal["optimized", "naive"] = "optimized"  # naive: a newcomer's defaults (baseline)
    records: int = 0  # the source's first N good records (a named subset); 0 = all of them
    epochs: int | None = None  # passes over the training records; unset = 1 (or --max-steps)
    max_steps: int | None = None  # optimizer steps to train instead of epochs
    batch_size: int = 16  # records per optimizer step in either plan (optimized packs them)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"  # the LR after its warm-up
    lr_warmup: float = 0.03  # share of the optimizer steps that warm the learning rate up
    eval_share: float = 0.01  # records held out for eval (at least eval_batch), never trained on
    eval_every: int = 0  # eval every N steps and at the end; 0 = up to 10x, under 10% of the run
    eval_batch: int = 8  # records per eval batch, one a row in both plans (so they compare)
    keep_checkpoints: int = 2  # the newest K checkpoints kept in out_dir
    merge: bool = False  # also write the 16-bit base with the adapter merged (out_dir/merged)
    progress_every: int = 0  # the stage shares so far every N steps; 0 = ten times over the run

    # a few steps on 48 records of the embedded data, with eval
    QUICK: ClassVar[dict[str, Any]] = {
        "records": 48, "batch_size": 8, "eval_share": 0.1, "eval_batch": 4, "seq_len": 96,
        "lora_r": 8, "lora_alpha": 16, "sweep_workers": [0, 2], "decide_budget_s": 20.0}
    IDENTITY: ClassVar[tuple[str, ...]] = (*JobConfig.IDENTITY, "plan", "records", "epochs",
        "max_steps", "batch_size", "lr_schedule", "lr_warmup", "eval_share", "eval_batch")

    def validate(self) -> None:
        super().validate()
        self._check(("epochs", "max_steps"), lambda v: v is None or whole(v) and v >= 1,
                    "must be a whole number >= 1 (or unset)")
        if self.epochs is not None and self.max_steps is not None:
            raise ValueError(f"TrainConfig: give epochs or max_steps, not both (got epochs="
                             f"{self.epochs}, max_steps={self.max_steps})")
        self._positive("batch_size", "eval_batch", "keep_checkpoints")
        self._non_negative("records", "eval_every", "progress_every")
        self._check(("eval_share",), lambda v: number(v) and 0 < v < 1, "must be in (0, 1)")
        self._check(("lr_warmup",), lambda v: number(v) and 0 <= v < 1, "must be in [0, 1)")
        if self.resume and not self.out_dir:
            raise ValueError("TrainConfig.resume: name the out_dir (--out-dir) of the run to "
                             "continue")
        if self.records:
            self.held_out(self.records)

    def held_out(self, records: int) -> int:
        """Records held out: eval_share, at least eval_batch; refused below one step left."""
        held = max(math.ceil(self.eval_share * records), self.eval_batch)
        if records - held < self.batch_size:
            raise ValueError(
                f"TrainConfig.eval_share={self.eval_share}: holds out {held} of {records} "
                f"records (at least eval_batch={self.eval_batch}), leaving {records - held} to "
                f"train on, less than one optimizer step of batch_size={self.batch_size}; lower "
                "eval_share or eval_batch, or train on more records")
        return held

    def enough(self) -> int:
        """Records past which held_out never refuses."""
        return max(self.batch_size + self.eval_batch,
                   math.ceil((self.batch_size + 1) / (1 - self.eval_share)))

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the run: max_steps, else epochs (unset: 1) x steps_per_epoch."""
        return self.max_steps or (self.epochs or 1) * steps_per_epoch

    @staticmethod
    def cadence(every: int, steps: int) -> int:
        """Steps between evals, saves or progress lines: `every`, or (0) ten over the run."""
        return every or max(1, steps // 10)

    def eval_cadence(self, steps: int, eval_records: int) -> int:
        """eval_every, or (0) ten evals a run, fewer where they cost over EVAL_SHARE of it."""
        if self.eval_every:
            return self.eval_every
        # an eval's record runs forward only: a third of a trained one's cost
        evals = EVAL_SHARE * steps * self.batch_size * 3 / max(eval_records, 1)
        return max(self.cadence(0, steps), math.ceil(steps / max(evals - 2, 1)))  # + first, last

    @classmethod
    def of_job(cls, job: JobConfig, quick: bool | None = False, **more: Any) -> TrainConfig:
        """The whole-dataset run of a measured job, with `more` (epochs, ...)."""
        shared = {f.name: getattr(job, f.name) for f in fields(JobConfig)}
        return cls.default(quick, **shared | {"checkpoint_every": 0, "out_dir": "",
                                                "resume": False} | more)

    def job(self) -> QLoraConfig:
        """The QLoRA job measured to decide the plan: MEASURED_STEPS steps of batch_size records."""
        shared = {f.name: getattr(self, f.name) for f in fields(JobConfig)}
        return QLoraConfig(**shared | {
            "checkpoint_every": 0, "out_dir": "", "resume": False, "plan": self.plan,
            "records": MEASURED_STEPS * self.batch_size, "steps": MEASURED_STEPS, "rounds": 1,
            "warmup_steps": min(self.warmup_steps, MEASURED_STEPS - 1)})
