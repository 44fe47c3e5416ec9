"""DDP on several GPUs: per-rank tokens/s, the comm_wait share, and the scaling efficiency N vs 1.

Prepared for a lent machine with >= 2 GPUs (CI does not run it; with fewer it says so and exits 0).
`python bench/gpu_ddp.py [--gpus 2]` launches itself under torchrun twice, on 1 GPU and on N,
each rank training GPT-2 small (diag.accum's shape, random init, bf16 autocast, seq 1024) on its
own windows of the synthetic token file for --steps steps, timed by diag's StageTimer (data_wait,
compute, comm_wait from the DDP communication hook), frames gathered on rank 0 at the end.
Scaling efficiency = tokens/s on N ranks / (N x tokens/s on 1). `--device cpu --model tiny`
runs the same path on CPU with gloo (a dry run of the script, not a GPU figure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(args: argparse.Namespace) -> None:
    import torch

    from diag.timing import stragglers
    from diag.mfu import loss_of
    from diag.accum.experiment import build_model
    from diag.config import AccumConfig
    from diag.data import BatchLoader, ensure_tokens
    from diag.timing.distributed import gathered_frame, init_group, root_first
    from diag.timing import StageTimer

    seat = init_group(args.device)
    dev = torch.device("cuda", seat.local_rank) if args.device == "cuda" else torch.device("cpu")
    cfg = AccumConfig(model=args.model, seq_len=args.seq_len, device=str(dev),
                      tokens_per_step=args.seq_len * args.micro_batch, micro_batches=[])
    with root_first():  # rank 0 tokenizes the synthetic set once; the others read its file
        tokens = ensure_tokens()
    model = build_model(cfg, dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else \
        contextlib.nullcontext()  # as diag accum's dtype "auto"
    ddp = torch.nn.parallel.DistributedDataParallel(model) if seat.distributed else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-4,
                                  **({"fused": True} if dev.type == "cuda" else {}))
    timer = StageTimer(device=dev)  # on CUDA each stage boundary is a sync point
    if seat.distributed:
        timer.watch_comm(ddp)
    with BatchLoader(tokens, args.micro_batch, args.seq_len, dev, seed=seat.rank) as loader:
        batches = (loader.next() for _ in range(args.warmup + args.steps))
        for x, y in timer.watch(batches, start_step=-args.warmup):
            with timer.stage("compute"):
                with amp:
                    loss = loss_of(ddp, x, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    frame = gathered_frame(timer)
    if not seat.is_root:
        return
    frame = frame[frame["step"] >= 0]  # warm-up steps (allocator, NCCL set-up) left out
    table = stragglers.per_rank(frame)
    step_s = table[["work_s", "comm_wait_s"]].sum(axis=1)
    table["tokens_per_s"] = args.micro_batch * args.seq_len / step_s
    table["comm_wait_share"] = table["comm_wait_s"] / step_s
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    found = stragglers.findings(frame)
    for row in found.itertuples():
        print(f"straggler: {row.finding} ({row.evidence})")
    Path(args.out).write_text(json.dumps({
        "ranks": seat.world_size, "tokens_per_s": float(table["tokens_per_s"].sum()),
        "comm_wait_share": float(table["comm_wait_share"].mean())}))


def launch(args: argparse.Namespace, ranks: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="diag-gpu-ddp-")) / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_port", str(29600 + ranks), str(Path(__file__).resolve()), "--worker",
           "--out", str(out), "--device", args.device, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the scaled run")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", choices=["gpt2-small", "tiny"], default="gpt2-small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per launch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < max(args.gpus, 2):
            print(f"gpu_ddp: needs {max(args.gpus, 2)} CUDA devices, this machine has "
                  f"{torch.cuda.device_count()}: nothing to measure")
            return 0
    one = launch(args, 1)
    many = launch(args, args.gpus)
    efficiency = many["tokens_per_s"] / (args.gpus * one["tokens_per_s"])
    print(f"tokens/s: 1 rank {one['tokens_per_s']:.4g}, {args.gpus} ranks "
          f"{many['tokens_per_s']:.4g}; comm_wait share on {args.gpus} ranks "
          f"{many['comm_wait_share']:.1%}")
    print(f"scaling_efficiency: {efficiency:.3f} ({args.gpus} ranks vs 1; 1.0 = linear)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
