"""What consumes a loader's batches (`consumer`): `EmulatedStep` holds the loop as DLIO emulates an
accelerator, `ModelStep` trains the tiny model; `run_toy`: the smallest timed training loop with
every step-level stage (an MLP, `prep_ms` of host work a batch, DDP under torchrun)."""
from __future__ import annotations

import itertools
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from diag.config import LoaderConfig, ToyConfig
from diag.machine.contention import GpuSampler
from diag.machine.device import GPUS, dense_peak_flops, on_cpu_threads, resolve, sync
from diag.timing import StageTimer, distributed


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


def busy_prep(ms: float) -> None:
    """Spin in Python for ms: preprocessing that holds a CPU (what a sampler sees as hot)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


class ToyBatches(Dataset):
    """Batch i of random features after prep_ms asleep or busy (here: workers must import it)."""

    def __init__(self, n: int, batch_size: int, width: int, prep_ms: float, seed: int = 0,
                 busy: bool = False) -> None:
        self.n, self.batch_size, self.width = n, batch_size, width
        self.prep_ms, self.seed, self.busy = prep_ms, seed, busy

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prep_ms:
            busy_prep(self.prep_ms) if self.busy else time.sleep(self.prep_ms / 1000)
        x = torch.randn(self.batch_size, self.width,
                        generator=torch.Generator().manual_seed(self.seed + i))
        return x, x.sum(dim=1, keepdim=True)


@on_cpu_threads
def run_toy(cfg: ToyConfig | None = None, timer: StageTimer | None = None):
    """Train the toy MLP for cfg.warmup_steps + cfg.steps; return the timer's frame."""
    cfg = cfg or ToyConfig.default()
    dev = resolve(cfg.device)
    seat = distributed.init_group(dev.type)  # a no-op on one process
    if seat.distributed and dev.type == "cuda":
        dev = torch.device("cuda", seat.local_rank)  # one GPU per rank
    timer = timer or StageTimer(device=dev)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    norm = [torch.nn.BatchNorm1d(cfg.width)] if cfg.batch_norm else []  # buffers DDP broadcasts
    model = torch.nn.Sequential(
        torch.nn.Linear(cfg.width, cfg.width), *norm, torch.nn.GELU(),
        torch.nn.Linear(cfg.width, 1)).to(dev)
    if seat.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
        timer.watch_comm(model)
        distributed.spill_ranks(timer, seat)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prep = cfg.prep_ms + (cfg.slow_ms if seat.rank == cfg.slow_rank else 0.0)
    batches = iter(DataLoader(  # each rank its own batches: seeds apart by the step count
        ToyBatches(cfg.warmup_steps + cfg.steps, cfg.batch_size, cfg.width, prep,
                   seed=seat.rank * (cfg.warmup_steps + cfg.steps), busy=cfg.prep == "busy"),
        batch_size=None, num_workers=cfg.num_workers, pin_memory=dev.type == "cuda",
        prefetch_factor=4 if cfg.num_workers else None, persistent_workers=False))

    def step(x, y) -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with timer.stage("warmup"):
        for _ in range(cfg.warmup_steps):
            step(*(t.to(dev) for t in next(batches)))
    with GpuSampler(dev) as util, timer.stage("train"):
        # islice: never ask past the last batch, or the workers' shutdown is billed to the steps
        for x, y in timer.watch(itertools.islice(batches, cfg.steps)):
            with timer.stage("h2d"):
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with timer.stage("compute"):
                step(x, y)
            timer.flush()  # a no-op on one process: the finished step survives a kill
    del batches  # worker shutdown happens here, outside every timed stage
    frame = distributed.gathered_frame(timer)  # every rank's rows on rank 0
    waits = (frame["stage"] == "data_wait") & (frame["rank"] == timer.rank)  # this rank's GPU
    frame = frame.assign(gpu_util_pct=float("nan"), gpu_util_note="")
    frame.loc[waits, list(util.columns())] = list(util.columns().values())  # was it idle then?
    return frame
