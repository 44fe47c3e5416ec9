"""A timed toy training loop, the smallest run with every step-level stage: an MLP on synthetic
batches with `prep_ms` of host work each, DDP under torchrun; its StageTimer frame and GPU util."""
from __future__ import annotations

import itertools
import time

import torch
from torch.utils.data import DataLoader, Dataset

from diag.config import ToyConfig
from diag.machine import device as devices
from diag.machine.device import on_cpu_threads
from diag.machine.contention import GpuSampler
from diag.timing import StageTimer, distributed


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
    dev = devices.resolve(cfg.device)
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
