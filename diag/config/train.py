"""`diag train`: the QLoRA job on the whole dataset, its adapter the output (diag.qlora.train)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from diag.config.base import number, whole
from diag.config.qlora import JobConfig, QLoraConfig

MEASURED_STEPS = 4  # optimizer steps of the job the plan is decided on
EVAL_SHARE = 0.1  # the default eval cadence keeps evals under this share of the training


@dataclass
class TrainConfig(JobConfig):
    """`diag train`: one plan trains the whole dataset (epochs, eval, checkpoints, resume); the
    adapter and tokenizer in out_dir are its output."""

    lr: float = 2e-4  # peak learning rate: warmed up over lr_warmup, then lr_schedule
    checkpoint_every: int = 0  # save adapter, optimizer, RNG, data position every N steps;
                               # 0 = ten times over the run
    out_dir: str = ""  # the adapter, tokenizer and checkpoints; "" = train/<UTC timestamp>
    results: str = ""  # a run folder: its decisions make the optimized plan, its costs the ETA;
                       # "" = measure on this job
    plan: Literal["optimized", "naive"] = "optimized"  # optimized: decided on the job (or
        # --results); naive: a newcomer's defaults (the baseline)
    records: int = 0  # the source's first N good records (a named subset); 0 = all of them
    epochs: int | None = None  # passes over the training records; unset = 1 (or --max-steps)
    max_steps: int | None = None  # optimizer steps to train instead of epochs
    batch_size: int = 16  # records per optimizer step in either plan (optimized packs them)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"  # the LR after its warm-up
    lr_warmup: float = 0.03  # share of the optimizer steps that warm the learning rate up
    eval_share: float = 0.01  # records held out for eval (at least eval_batch), never trained on
    eval_every: int = 0  # eval every N optimizer steps and at the end; 0 = up to ten times over
                         # the run, as often as keeps eval under 10% of it
    eval_batch: int = 8  # records per eval batch, one a row in both plans (so they compare)
    keep_checkpoints: int = 2  # the newest K checkpoints kept in out_dir
    merge: bool = False  # also write the 16-bit base with the adapter merged (out_dir/merged)
    progress_every: int = 0  # the stage shares so far every N steps; 0 = ten times over the run

    # a few steps on 48 records of the embedded data, with eval
    QUICK: ClassVar[dict[str, Any]] = {"records": 48, "batch_size": 8, "eval_share": 0.1,
                                       "eval_batch": 4, "seq_len": 96, "lora_r": 8,
                                       "lora_alpha": 16, "sweep_workers": [0, 2],
                                       "decide_budget_s": 20.0}
    IDENTITY: ClassVar[tuple[str, ...]] = (*JobConfig.IDENTITY, "plan", "records", "epochs",
                                           "max_steps", "batch_size", "lr_schedule",
                                           "lr_warmup", "eval_share", "eval_batch")

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
        """Records held out of `records`: eval_share, at least one eval batch; refused where less
        than one optimizer step is left to train on."""
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
        """Steps between evals: eval_every, or (0) ten over the run, fewer where those would
        cost over EVAL_SHARE of the training (an eval's record runs forward only: a third)."""
        if self.eval_every:
            return self.eval_every
        evals = EVAL_SHARE * steps * self.batch_size * 3 / max(eval_records, 1)  # affordable
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
