"""`diag qlora`: the QLoRA job's configs (diag.qlora). `JobConfig` is what `diag qlora` and
`diag train` share; `QLoraConfig` adds the side-by-side comparison's records, steps and rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from diag.config.loader import ON_ERROR
from diag.config.base import number
from diag.config.source import SourceConfig

QLoraPlan = Literal["naive", "optimized", "both"]


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
    resume: bool = False  # continue from the last checkpoint in out_dir, if there is one
    out_dir: str = ""  # checkpoints; "" = a fresh temporary folder per run
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:N"; CUDA-only settings fall back on CPU
    results: str = ""  # run folder whose decisions.csv the optimized plan collects; "" = measure
    # the sweeps on the job's own step that decide the optimized plan
    sweep_micro_batches: list[int] = field(default_factory=list)  # [] = up to 4 divisors of
        # the job's rows per step, 1 and the largest among them
    sweep_workers: list[int] = field(default_factory=lambda: [0, 1, 2])  # num_workers the
        # loader sweep tries
    sweep_steps: int = 5  # timed steps per sweep point, after one warm-up; 5 is the fewest a
        # gap resolves with
    decide_budget_s: float = 60.0  # seconds to re-time points the screen left within noise
        # (0: screen only); more settles closer gaps

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
        self._choice("on_error", ON_ERROR)
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
    """`diag qlora`: the QLoRA fine-tune, naive vs optimized."""

    plan: QLoraPlan = "both"  # "naive" (a newcomer's defaults), "optimized" (the fixes) or both
    records: int = 128  # records both plans train on once (the same tokens)
    steps: int = 8  # optimizer steps both plans take over those records (same LR schedule)
    rounds: int = 3  # plans run interleaved this many times (order alternating); medians + spread
    slow_rank: int = -1  # under torchrun: this rank's loader sleeps slow_ms
                         # more per batch (a straggler on purpose); -1 = none
    slow_ms: float = 0.0  # the extra per-batch sleep of slow_rank, in milliseconds

    IDENTITY: ClassVar[tuple[str, ...]] = (*JobConfig.IDENTITY, "plan", "records", "steps")
    # one round of each plan: a quick look with no spread
    QUICK: ClassVar[dict[str, Any]] = {"records": 12, "steps": 3, "seq_len": 96, "lora_r": 8,
                                       "lora_alpha": 16, "sweep_workers": [0, 2],
                                       "decide_budget_s": 20.0, "rounds": 1}
    # `diag run`: smaller sweeps and rounds, never fewer rounds (their spread says whether the
    # headline's gap resolved)
    RUN: ClassVar[dict[str, Any]] = {"sweep_workers": [0, 2], "decide_budget_s": 30.0,
                                     "records": 32, "steps": 4, "rounds": 3}

    def validate(self) -> None:
        super().validate()
        self._positive("records", "steps")
        self._whole("rounds")
        self._straggler()
        self._check(("steps",), lambda v: v <= self.records, f"at most records={self.records} "
                    "(each optimizer step needs at least one record)")
        self._check(("warmup_steps",), lambda v: v < self.steps, f"must be below steps="
                    f"{self.steps}, so some steps are measured in steady state")
