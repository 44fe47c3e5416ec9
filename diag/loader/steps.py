"""What consumes the batches: `EmulatedStep` holds the loop as DLIO emulates an accelerator
(would this loader keep up with an X ms step?), `ModelStep` trains the tiny model."""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from diag.config import LoaderConfig
from diag.machine.device import sync
from diag.machine.gpus import GPUS, dense_peak_flops


class EmulatedStep:
    """A step that takes `seconds` and leaves the CPU free, as an accelerator's step would."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, batch: dict[str, torch.Tensor]) -> None:
        # sleep, not a busy loop: while a GPU computes, the host's cores are free for workers
        end = time.perf_counter() + self.seconds
        while (left := end - time.perf_counter()) > 0:
            time.sleep(left)


class ModelStep:
    """One training step of a causal LM from `model_dir` on `device`: forward, backward, AdamW."""

    def __init__(self, model_dir: str | Path, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def __call__(self, batch: dict[str, torch.Tensor]) -> None:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        self.model(**batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)  # note: sync point, so the step's kernels are billed to the step


def measure_model_step(model_dir: str | Path, device: torch.device, batch_size: int, seq_len: int,
                       warmup: int = 2, repeats: int = 3) -> float:
    """Median seconds of the model's training step on full batch_size x seq_len batches."""
    step = ModelStep(model_dir, device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, step.model.config.vocab_size, (batch_size, seq_len), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    times = []
    for _ in range(warmup + repeats):
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])  # the first pay allocator growth, kernel choice


def gpu_step_seconds(gpu: str, params_b: float, tokens: int, mfu: float) -> float:
    """Estimated seconds of a step on `gpu`: 6 x params x tokens FLOPs at mfu x its bf16 peak."""
    peak = dense_peak_flops(gpu, "bf16")
    if peak is None:
        raise ValueError(f"LoaderConfig.gpu={gpu!r}: not in diag's table; allowed values are "
                         + ", ".join(g.name for g in GPUS))
    return 6 * params_b * 1e9 * tokens / (peak * mfu)


def consumer(cfg: LoaderConfig, model_dir: str | Path, device: torch.device
             ) -> tuple[Any, float, str]:
    """(step, nominal seconds, source): the model's, or one emulated (step_ms, gpu's, measured)."""
    if cfg.consumer == "model":
        return ModelStep(model_dir, device), math.nan, f"the model in {model_dir}, {device.type}"
    tokens = cfg.batch_size * cfg.seq_len
    if cfg.step_ms > 0:
        seconds, source = cfg.step_ms / 1000, f"given: {cfg.step_ms:g} ms"
    elif cfg.gpu:
        seconds = gpu_step_seconds(cfg.gpu, cfg.model_params_b, tokens, cfg.mfu)
        source = (f"estimated for {cfg.gpu}: 6 x {cfg.model_params_b:g}B params x {tokens} "
                  f"tokens at {cfg.mfu:.0%} MFU")
    else:
        seconds = measure_model_step(model_dir, device, cfg.batch_size, cfg.seq_len)
        source = (f"measured: the tiny model's training step on {device.type}, "
                  f"{cfg.batch_size} x {cfg.seq_len} tokens")
    return EmulatedStep(seconds), seconds, source
