"""`diag accum`: the grad-accum experiment's config (diag.accum)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from diag.config.base import ExperimentConfig, parse_list, whole

ACCUM_MODELS = {"tiny": 2048, "gpt2-small": 1024}  # model -> context (positions) it accepts


@dataclass
class AccumConfig(ExperimentConfig):
    """`diag accum`: grad accumulation at constant tokens per step: tokens/s, memory, MFU
    (cross-checked), the floor."""

    tokens_per_step: int = 4096  # tokens per optimizer step, the same at every point
    seq_len: int = 128  # tokens per sequence (nanoGPT's block_size); at most the model's context
    micro_batches: list[int] = field(default_factory=list)  # [] = powers of 2 dividing the step
    steps: int = 5  # timed optimizer steps per point; 5 is the fewest a gap resolves with
    warmup_steps: int = 1  # untimed first steps per point (allocator, compile): warmup_s
    model: str = "tiny"  # "tiny": the embedded Llama (CPU); "gpt2-small": GPT-2 124M, random init
    compile: bool = False  # torch.compile each point: faster steps, compile time in warmup_s
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # autocast dtype; "auto": bf16 CUDA, fp32 CPU
    device: str = "auto"  # "auto", "cpu" or "cuda"
    token_file: str = ""  # a nanoGPT-style train.bin (uint16 ids); "" = the synthetic dataset
    peak_tflops: float = 0.0  # dense peak for MFU; 0 = diag's table (CUDA) or a CPU probe
    steps_per_run: int = 5000  # optimizer steps in your run: prices the advice per run
    seed: int = 0  # window sampling and the gpt2-small init
    slow_rank: int = -1  # under torchrun: its loader sleeps slow_ms more per micro-batch; -1: none
    slow_ms: float = 0.0  # slow_rank's extra sleep per micro-batch (a straggler on purpose), in ms

    QUICK: ClassVar[dict[str, Any]] = {"tokens_per_step": 1024, "seq_len": 64,
                                       "micro_batches": [2, 16], "steps": 5}
    # a lent H200's shape: GPT-2 small, block 1024, 131k tokens per step
    GPU: ClassVar[dict[str, Any]] = {"model": "gpt2-small", "seq_len": 1024,
                                     "tokens_per_step": 131072, "micro_batches": [8, 16, 32, 64]}
    # `diag run --no-qlora` on a CPU: three points span the trade-off in minutes
    CPU: ClassVar[dict[str, Any]] = {"micro_batches": [2, 8, 32], "steps": 5}

    def validate(self) -> None:
        name = type(self).__name__
        self._whole("tokens_per_step", "seq_len", "steps", "steps_per_run")
        self._whole("warmup_steps", "seed", low=0)
        self._non_negative("peak_tflops")
        if self.compile and self.warmup_steps < 1:
            raise ValueError(f"{name}.warmup_steps=0: compile=True needs >= 1 warm-up step, where "
                             "the compile happens (it must not land in the timed steps)")
        self._choice("model", tuple(ACCUM_MODELS))
        context = ACCUM_MODELS[self.model]
        self._check(("seq_len",), lambda v: v <= context, f"above the context of model "
                    f"{self.model!r} ({context} positions); allowed 1..{context}")
        self._check(("tokens_per_step",), lambda v: v % self.seq_len == 0, f"not divisible by "
                    f"seq_len={self.seq_len}; allowed: a multiple of it, e.g. "
                    f"{max(1, round(self.tokens_per_step / self.seq_len)) * self.seq_len}")
        sequences = self.tokens_per_step // self.seq_len
        self.micro_batches = parse_list(self.micro_batches, int)
        allowed = [m for m in range(1, sequences + 1) if sequences % m == 0]
        for m in self.micro_batches:
            if not whole(m) or m not in allowed:
                raise ValueError(
                    f"{name}.micro_batches: {m!r} x seq_len={self.seq_len} does not divide "
                    f"tokens_per_step={self.tokens_per_step}; allowed micro-batches: "
                    + ", ".join(map(str, allowed)))
        # under a launcher every rank refuses a world that cannot split the step, before torch
        world = os.environ.get("WORLD_SIZE", "1").strip()
        for m in self.micro_batches if world.isdigit() and int(world) > 1 else []:
            check_divides(self.tokens_per_step, self.seq_len, m, int(world),
                          field=f"{name}.tokens_per_step")


def check_divides(tokens_per_step: int, seq_len: int, micro_batch: int, world_size: int,
                  field: str = "tokens_per_step") -> None:
    """Raise a ValueError naming the numbers when the world cannot split a step evenly."""
    sequences = tokens_per_step // seq_len
    if sequences % (world_size * micro_batch):
        fits = [m for m in range(1, sequences // world_size + 1)
                if sequences % (world_size * m) == 0]
        raise ValueError(
            f"{field}={tokens_per_step} ({sequences} sequences of {seq_len}) is not divisible "
            f"by world size {world_size} x micro-batch {micro_batch} = "
            f"{world_size * micro_batch}; micro-batches that divide it at this world size: "
            + (", ".join(map(str, fits)) or f"none (make {field} a multiple of "
               f"{world_size * seq_len})"))
