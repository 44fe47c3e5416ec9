"""The frames Plan.optimized reads, measured against the QLoRA job's own step on this machine.

`measure_results(cfg)` runs the accum sweep (micro-batch at constant tokens per step, with its
peak memory) and then diag.loader's worker sweep with the real consumer: `QLoraStep`, one
forward/backward/AdamW step of the nf4 base + LoRA the job trains, at the chosen micro-batch.
It also times QLoraStep with gradient checkpointing on and off ("checkpointing": what the
knob costs per step). Returns the `results` Plan.optimized and run_qlora take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import QLoraConfig


class QLoraStep:
    """One optimizer step of the job's model (nf4 base, LoRA adapters), as the Trainer takes it:
    forward, backward, AdamW on the adapters; a loader sweep's consumer."""

    def __init__(self, cfg: QLoraConfig, model_dir: Any, device: Any,
                 gradient_checkpointing: bool = False) -> None:
        import dataclasses

        import torch

        from diag.device import sync
        from diag.qlora.job import load_model
        from diag.qlora.plans import Plan

        plan = dataclasses.replace(Plan.naive(), gradient_checkpointing=gradient_checkpointing)
        self.device, self._sync = device, sync
        self.model = load_model(cfg, plan, model_dir, device)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr)

    def __call__(self, batch: dict[str, Any]) -> None:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        self.model(**batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync(self.device)  # note: sync point, so the step's kernels are billed to the step


def measure_results(cfg: QLoraConfig, micro_batches: list[int] | None = None,
                    workers: list[int] | None = None, loader_steps: int = 4
                    ) -> dict[str, pd.DataFrame]:
    """Accum sweep first (it picks the micro-batch), then the loader sweep at that micro-batch
    with QLoraStep as the consumer. Quick-sized: a few steps per point."""
    from diag.accum import run_accum
    from diag.config import AccumConfig, LoaderConfig
    from diag.device import resolve
    from diag.embedded import ensure_assets
    from diag.loader.sweep import sweep_workers
    from diag.qlora.plans import Plan

    micro_batches = micro_batches or [1, 2, 4, 8]
    accum = run_accum(AccumConfig.default(
        quick=True, device=cfg.device, seq_len=cfg.seq_len,
        tokens_per_step=max(micro_batches) * cfg.seq_len, micro_batches=micro_batches)).frame
    micro = Plan.optimized({"accum": accum}, device=str(resolve(cfg.device))).micro_batch
    assets = ensure_assets()
    device = resolve(cfg.device)
    checkpointing = _checkpointing(cfg, assets.model_dir, device, micro)
    step = QLoraStep(cfg, assets.model_dir, device)
    loader_cfg = LoaderConfig.default(
        quick=True, device=cfg.device, consumer="model", batch_size=micro, seq_len=cfg.seq_len,
        workers=workers or [0, 2], steps=loader_steps, repeats=1)
    loader = sweep_workers(loader_cfg, (step, float("nan"),
                                        f"the QLoRA step (nf4 + LoRA r={cfg.lora_r}), "
                                        f"{micro} x {cfg.seq_len} tokens, {device.type}"))
    return {"accum": accum, "loader": loader, "checkpointing": checkpointing}


def _checkpointing(cfg: QLoraConfig, model_dir: Any, device: Any, micro: int,
                   steps: int = 3) -> pd.DataFrame:
    """Seconds per QLoRA step with gradient checkpointing on and off, after one warm-up step
    each; the two alternate step by step, so a load change on a shared machine hits both."""
    import time

    import pandas as pd
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    runs = {on: QLoraStep(cfg, model_dir, device, gradient_checkpointing=on)
            for on in (True, False)}
    vocab = runs[True].model.config.vocab_size
    ids = torch.randint(4, vocab, (micro, cfg.seq_len), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    rows = []
    for i in range(steps + 1):
        for on, step in runs.items():
            start = time.perf_counter()
            step(batch)
            if i:  # the first step pays allocator growth and kernel choice
                rows.append({"gradient_checkpointing": on, "micro_batch": micro,
                             "seconds": time.perf_counter() - start})
    return pd.DataFrame(rows)
