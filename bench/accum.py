"""Is diag's batch loader at least as fast as nanoGPT's get_batch, and what does the sweep span?

(a) Side by side in one process, on the same token file and batch shape (16 x 1024, the seed's),
alternating order each round, medians of the per-round ratios: diag's BatchLoader (map kept
open, one gather per batch, next batch prepared in a thread) vs nanoGPT's get_batch pattern (a
new memmap per call, per-row slicing, two stacks), both ending with the batch on the device.
(b) The grad-accum sweep at its defaults: best vs worst tokens/s (information, no goal).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.accum import run_accum  # noqa: E402
from diag.config import AccumConfig  # noqa: E402
from diag.data import BatchLoader, ensure_tokens  # noqa: E402
from diag.machine.device import resolve, sync  # noqa: E402

BATCH, BLOCK = 16, 1024  # the seed's micro-batch: 16 x 1024 tokens
BATCHES = 200  # per round and loader; enough that a round takes ~0.1-1 s
ROUNDS = 7  # measured rounds after one warm-up round


def nanogpt_get_batch(path: Path, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's train.py get_batch, as written there (device_type branch included)."""
    # nanoGPT: "We recreate np.memmap every batch to avoid a memory leak"
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - BLOCK, (BATCH,))
    x = torch.stack([torch.from_numpy((data[i:i + BLOCK]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + BLOCK]).astype(np.int64)) for i in ix])
    if device.type == "cuda":
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


def batches_per_s(next_batch, device: torch.device) -> float:
    sync(device)  # note: sync point: start on an idle device
    start = time.perf_counter()
    for _ in range(BATCHES):
        x, y = next_batch()
    sync(device)  # note: sync point: the last copy has landed
    return BATCHES / (time.perf_counter() - start)


def main() -> None:
    device = resolve("auto")
    tokens = ensure_tokens()
    assert tokens.dtype == "uint16"  # nanoGPT's get_batch reads uint16
    rates: dict[str, list[float]] = {"diag": [], "nanogpt": []}
    with BatchLoader(tokens, BATCH, BLOCK, device, seed=0) as loader:
        runs = {"diag": loader.next, "nanogpt": lambda: nanogpt_get_batch(tokens.path, device)}
        for r in range(-1, ROUNDS):
            for who in (("diag", "nanogpt") if r % 2 == 0 else ("nanogpt", "diag")):
                rate = batches_per_s(runs[who], device)
                if r >= 0:
                    rates[who].append(rate)
    ratio = statistics.median(d / n for d, n in zip(rates["diag"], rates["nanogpt"]))

    cfg = AccumConfig.default(device=str(device))
    sweep = run_accum(cfg).summary
    ok = sweep[sweep["status"] == "ok"]
    best, worst = ok.loc[ok["tokens_per_s"].idxmax()], ok.loc[ok["tokens_per_s"].idxmin()]

    print(f"token file {tokens.tokens:,} ids ({tokens.dtype}), batch {BATCH} x {BLOCK} "
          f"on {device}, {torch.get_num_threads()} threads, {ROUNDS} rounds of {BATCHES} "
          "batches after 1 warm-up")
    for who in rates:
        print(f"{who} loader: {statistics.median(rates[who]):,.0f} batches/s (median)")
    for row in sweep.itertuples():
        mfu = f", MFU {row.mfu:.1%}" if row.mfu == row.mfu else ""
        print(f"sweep {row.micro_batch} x {row.grad_accum}: " + (
            f"{row.tokens_per_s:,.0f} tokens/s, {row.seconds_per_step:.3g} s/step "
            f"(floor {row.floor_s:.3g} s){mfu}, {row.peak_mem_gb:.2f} GB" if row.status == "ok"
            else row.status))
    print(f"accum_sweep_best_vs_worst: {best['tokens_per_s'] / worst['tokens_per_s']:.2f}x "
          f"({int(best['micro_batch'])} x {int(best['grad_accum'])} vs "
          f"{int(worst['micro_batch'])} x {int(worst['grad_accum'])}, {cfg.model} at "
          f"{cfg.tokens_per_step:,} tokens per step; information)")
    print(f"accum_loader_vs_nanogpt_get_batch: {ratio:.3f} (goal >= 1.0)")


if __name__ == "__main__":
    main()
