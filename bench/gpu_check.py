"""The optimized QLoRA plan on a CUDA device, bounded: tokens/s, MFU, pinned H2D GB/s, shares.

Prepared for a lent GPU (CI does not run it; on a CPU it says so and exits 0). A Llama model with
random weights is made locally (default the "small" shape, ~100M parameters; --hidden 2048
--layers 22 --heads 32 --intermediate 5632 for TinyLlama's 1.1B shape) and served by the
embedded hub; the dataset by the embedded S3. The QLoRA MFU is diag.mfu's, per token
slot of the steady steps: executed FLOPs (forward, input gradients through the frozen 4-bit
base, LoRA weight gradients, attention) beside model FLOPs (6N + 12·L·d·T, 8N + 16·L·d·T with
activation checkpointing), against the dense table's peaks of the precisions the step ran in,
executed cross-checked by FlopCounterMode on one step with the 4-bit forward added back (a gap
over MFU_DISAGREEMENT flagged). `qlora_vs_trl`: trained tokens/s of the
optimized plan's train loop against TRL's SFTTrainer(packing=True) on the same model, records,
steps, micro-batch and checkpointing (bench/qlora_trl.py).
Last a short `diag train` of the same plan (--train-steps): its ETA error, steady compute share,
held-out loss and MFU (train_check). Runs in under 5 minutes on an H100/H200 at the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pinned_h2d_gb_s(mb: int = 512, repeats: int = 5) -> float:
    import torch

    host = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()  # note: sync point, warm-up copy done
    start = time.perf_counter()
    for _ in range(repeats):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()  # note: sync point, the copies are queued, not done
    return repeats * host.numel() / (time.perf_counter() - start) / 1e9


@contextlib.contextmanager
def sources(args: argparse.Namespace):
    from diag.config import diag_home
    from diag.embedded import (
        HubServer,
        S3Server,
        publish_model,
        synthetic_dataset,
        tiny_model,
    )
    from diag.qlora.job import Sources

    home = diag_home() / "gpu_check"
    data = synthetic_dataset(home / "data.jsonl", records=args.records, seed=0)
    shape = f"h{args.hidden}-l{args.layers}"
    folder = home / "models" / shape
    if not (folder / "config.json").is_file():
        tiny_model(folder, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                   intermediate_size=args.intermediate or None, vocab_size=32000, dataset=data)
    repo = f"diag-local/{shape}"
    publish_model(folder, home / "hub", repo)
    with S3Server() as s3, HubServer(home / "hub") as hub:
        s3.upload(data, "gpu_check/data.jsonl")
        yield Sources(f"s3://{s3.bucket}/gpu_check/data.jsonl", s3.client(), repo, hub.endpoint)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=0)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=60, help="the short diag train's")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine (nothing measured)")
        return 0
    from diag.amdahl import shares
    from diag.config import QLoraConfig
    from diag.qlora import Plan
    from diag.qlora.job import prepare, run_plan

    start = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"pinned_h2d_gb_s: {pinned_h2d_gb_s():.1f}")
    cfg = QLoraConfig(records=args.records, steps=args.steps, seq_len=args.seq_len,
                      device="cuda", warmup_steps=2)
    with sources(args) as src:
        plan = dataclasses.replace(Plan.optimized(device="cuda"), micro_batch=args.micro_batch)
        prepare(cfg, plan, src)
        got = run_plan(cfg, plan, src)
    summary, stages = got.summary, got.stages
    steps = stages[stages["step"].notna()]
    per_step = float(steps.groupby("step")["seconds"].sum().median())
    tokens_per_step = summary["real_tokens"] / summary["steps"]
    tokens_per_s = tokens_per_step / per_step
    from diag.config import diag_home
    from diag.qlora.base import load_model
    from diag.mfu import count_step, qlora_check, qlora_shape, step_peak

    home = diag_home() / "gpu_check"
    folder, data_path = home / "models" / f"h{args.hidden}-l{args.layers}", home / "data.jsonl"
    model = load_model(cfg, plan, folder, torch.device("cuda"))
    model.train()
    qshape = qlora_shape(model, args.seq_len, bool(summary["gradient_checkpointing"]))
    counter, executed = count_step(model, summary["micro_batch"], args.seq_len)
    check = qlora_check(qshape, executed, counter)
    del model
    torch.cuda.empty_cache()
    peak = step_peak(executed, "cuda")
    print(f"plan: micro {summary['micro_batch']} x accum {summary['grad_accum']}, workers "
          f"{summary['num_workers']}, checkpointing {summary['gradient_checkpointing']}, "
          f"{summary['pipeline']}, padding {summary['padding_share']:.1%}")
    print(f"step_s: {per_step:.3f}; tokens_per_s: {tokens_per_s:,.0f}; N = "
          f"{qshape.shape.params / 1e6:.1f}M ({qshape.adapters / 1e6:.2f}M LoRA)")
    print(check[["method", "flops_per_token", "vs_executed", "flagged", "note"]].to_string(
        index=False))
    steady = summary["token_slots"] / summary["steps"]  # token slots a step runs
    print_mfu("qlora_mfu", per_step, steady, (qshape, executed, counter, peak))
    flagged = bool(check["flagged"].any())
    print(f"qlora_mfu_counter_check: {'FLAGGED' if flagged else 'ok'} "
          f"({check.iloc[-1]['note']})")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from qlora_trl import loop_seconds, trl_loop

    mine = summary["real_tokens"] / loop_seconds(stages)
    seconds, tokens = trl_loop(cfg, plan, folder, data_path)
    print(f"qlora_vs_trl: {mine * seconds / tokens:.3g} (trained tokens/s of the train loop, "
          f"one run a side: diag optimized {mine:,.0f}, TRL SFTTrainer packing=True "
          f"{tokens / seconds:,.0f}: {tokens} tokens in {seconds:.3g} s) (goal >= 1.0)")
    print(shares(stages).to_string(index=False))
    train_check(args, plan, got, (qshape, executed, counter, peak))
    print(f"gpu_check_seconds: {time.perf_counter() - start:.0f} (goal < 300)")
    return 0


def print_mfu(name: str, seconds: float, slots: float, counted: tuple) -> None:
    """MFU of `slots` token slots in `seconds`, by executed FLOPs and by model FLOPs."""
    from diag.mfu import plan_mfu

    for row in plan_mfu(name, seconds, slots, *counted):
        mfu = f"{row['mfu']:.1%}" if not math.isnan(row["mfu"]) else "n/a"
        print(f"{name}: {mfu} of {row['flops']} ({row['peak']})")


def train_check(args: argparse.Namespace, plan, run, counted: tuple) -> None:
    """A short `diag train` of the same plan on the same data (--train-steps steps of the run's
    records per step, 1% held out), its ETA priced by the run above (as --results would):
    the same figures as bench/train.py, and its MFU."""
    from diag.config import TrainConfig, diag_home
    from diag.forecast.costs import table
    from diag.forecast.eta import runs_costs
    from diag.qlora import run_train

    micro = plan.decision("micro_batch").capped(args.micro_batch, "gpu_check's --micro-batch")
    decided = [micro if d.setting == "micro_batch" else d for d in plan.decisions]
    cfg = TrainConfig(records=args.records, batch_size=args.records // args.steps,
                      seq_len=args.seq_len, max_steps=args.train_steps, device="cuda",
                      out_dir=str(diag_home() / "gpu_check" / f"train-{time.time():.0f}"))
    with sources(args) as src:
        got = run_train(cfg, decided, src=src, costs=runs_costs(table(run.costs), plan.name))
    row, ran = got.frame.iloc[0], got.stages
    train_s = float(ran.loc[ran["step"].isna() & (ran["stage"] == "train"), "seconds"].sum())
    compute = float(ran.loc[ran["stage"] == "compute", "seconds"].sum())
    print(got.eta[["stage", "predicted_s", "measured_s", "error_share"]].to_string(index=False))
    print(f"train_projection_error: {row['eta_error']:.3g} ({row['predicted_s']:.3g} s "
          f"projected, {row['seconds']:.3g} s measured, {int(row['steps'])} steps)")
    if row["eta_s"] == row["eta_s"]:  # None (NaN in the frame) when too few steps to pace
        print(f"train_eta_error: {abs(row['command_s'] - row['eta_s']) / row['eta_s']:.3g} "
              f"(ETA {row['eta_s']:.3g} s, the command {row['command_s']:.3g} s)")
    print(f"train_steady_compute_share: {compute / train_s:.3g}")
    print(f"train_eval_loss: {row['first_eval_loss']:.4f} -> {row['final_eval_loss']:.4f}")
    steady = row["trained_tokens"] * (row["steps"] - cfg.warmup_steps) / row["steps"]
    print_mfu("train_qlora_mfu", train_s, steady, counted)  # its trained tokens, as before


if __name__ == "__main__":
    sys.exit(main())
