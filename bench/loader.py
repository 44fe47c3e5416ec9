"""Does the optimized pipeline keep up with this machine's own step, and what does it buy?

Side by side in one run, on the embedded dataset and tokenizer: the tiny model's training step is
measured here (batch x seq_len tokens); the sweep (naive and packed pipelines, num_workers 0, 1, 2,
4) runs against an emulated step of that length; the packed pipeline at its recommended setting
must keep data_wait under 2% of the step. Then each pipeline alone (a zero-length step, rounds
alternating the order) gives the naive vs optimized samples/s and tokens/s ratios, and the token
cache's build and hit times, its rebuild (in-process vs 2 processes) and the sweep at
an H100's estimated step for a 1.1B model (a step a fast GPU sets) are printed.
Last line: `loader_data_wait_share: <percent> (goal < 2%)`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from diag.config import LoaderConfig
from diag.data import build_token_cache
from diag.embedded import ensure_assets
from diag.loader import recommend, sweep_workers
from diag.loader.toy import EmulatedStep, measure_model_step
from diag.loader.sweep import Setting, make_dataset, measure_setting


def alone(cfg: LoaderConfig, data: str, tok: str, rounds: int) -> dict[str, dict[str, float]]:
    """Each pipeline's own rate at num_workers=0 with no step: what the loop pays per sample."""
    sets = {p: make_dataset(p, cfg, data, tok)[0] for p in ("naive", "packed")}
    got: dict[str, dict[str, list[float]]] = {p: {"samples": [], "tokens": []} for p in sets}
    for r in range(rounds):
        for p in (("naive", "packed") if r % 2 == 0 else ("packed", "naive")):
            row = measure_setting(sets[p], Setting(0), EmulatedStep(0.0), pipeline=p,
                                  batch_size=cfg.batch_size, steps=cfg.steps)[0]
            got[p]["samples"].append(row["samples_per_s"])
            got[p]["tokens"].append(row["tokens_per_s"])
    return {p: {k: statistics.median(v) for k, v in d.items()} for p, d in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    assets = ensure_assets()
    data, tok = str(assets.dataset), str(assets.model_dir)
    print(f"cores: {len(os.sched_getaffinity(0))}, load average: {os.getloadavg()[0]:.1f}")

    with tempfile.TemporaryDirectory() as tmp:
        built = build_token_cache(data, tok, cache_dir=tmp)
        hit = build_token_cache(data, tok, cache_dir=tmp)
        print(f"token cache: {built.records} records, {built.tokens} tokens: "
              f"build {built.seconds:.2f} s"
              f" ({built.status}), reuse {hit.seconds * 1e3:.1f} ms ({hit.status})")
        for n in (1, 2):  # bench/data.py measures the build against tokenizers' own rate
            times = [build_token_cache(data, tok, cache_dir=tmp, num_proc=n, rebuild=True).seconds
                     for _ in range(args.rounds)]
            print(f"token cache rebuilt, num_proc={n}: {statistics.median(times):.2f} s "
                  f"(median of {args.rounds})")

    step_s = measure_model_step(tok, torch.device("cpu"), args.batch_size, args.seq_len)
    print(f"tiny model training step here ({args.batch_size} x {args.seq_len} tokens, cpu): "
          f"{step_s * 1e3:.1f} ms")
    cfg = LoaderConfig(batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                       repeats=1, step_ms=step_s * 1e3, device="cpu")
    sweep = sweep_workers(cfg)
    rec = recommend(sweep, cfg.target_share).set_index("pipeline")
    for p, r in rec.iterrows():
        print(f"{p}: {r['verdict']}")

    # the same sweep against the step a 1.1B model would take on an H100 (the device table):
    # where a fast GPU, not this CPU, sets the pace the loader has to keep
    fast = cfg.replace(step_ms=0.0, gpu="H100 SXM")
    fast_rec = recommend(sweep_workers(fast), fast.target_share).set_index("pipeline")
    for p, r in fast_rec.iterrows():
        print(f"{p} at an H100 step of a 1.1B model ({r['step_ms']:.0f} ms): {r['verdict']}")

    rates = alone(cfg.replace(steps=max(args.steps, 30)), data, tok, args.rounds)
    for kind in ("samples", "tokens"):
        ratio = rates["packed"][kind] / rates["naive"][kind]
        print(f"loader_packed_vs_naive_{kind}_per_s: {ratio:.2f}x (naive "
              f"{rates['naive'][kind]:,.0f}/s, packed {rates['packed'][kind]:,.0f}/s, "
              "pipeline alone, num_workers=0)")
    packed = rec.loc["packed"]
    print(f"loader_data_wait_share: {packed['data_wait_share']:.2%} (goal < 2%) at "
          f"num_workers={packed['recommended_workers']} against a {packed['step_ms']:.0f} ms step")
    return 0 if packed["data_wait_share"] < cfg.target_share else 1


if __name__ == "__main__":
    sys.exit(main())
