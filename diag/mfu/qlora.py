"""The QLoRA step's FLOPs as executed (hooks on every linear layer, checked by FlopCounterMode)
and each plan's MFU against its precisions' peak; model FLOPs are shown beside, not as it."""
from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd

from diag.machine.device import Peak, _dtype, peak_flops, resolve
from diag.mfu.formula import (ModelShape, count_flops, depth_width, disagreement, judge_mfu,
                              over_ranks)
from diag.timing import StageTimer

EXECUTED = "executed (fwd + input grads + LoRA grads + attention)"  # as every table names it


@dataclass(frozen=True)
class QLoraShape:
    """The model-FLOPs formula's inputs for a 4-bit base with LoRA adapters."""

    shape: ModelShape  # params: every matmul weight, the 4-bit base at in x out
    frozen: int  # the base's: no weight gradient is computed for them
    adapters: int  # the LoRA weights
    checkpointing: bool

    @property
    def flops_per_token(self) -> float:
        return self.shape.training_flops(recompute=self.checkpointing)

    @property
    def formula(self) -> str:
        return "8N + 16·L·d·T" if self.checkpointing else "6N + 12·L·d·T"


@dataclass(frozen=True)
class Executed:
    """FLOPs per token one step ran, by part, and by the precision each matmul ran in."""

    forward: float  # a recomputed forward twice
    input_grads: float  # to the inputs that require a gradient
    weight_grads: float  # the LoRA weights'
    attention: float  # QK^T and AV, the full T x T
    forward_4bit: float  # of `forward`: bitsandbytes' (FlopCounterMode sees none)
    by_dtype: tuple[tuple[str, float], ...]  # (precision, FLOPs per token)

    @property
    def total(self) -> float:
        return self.forward + self.input_grads + self.weight_grads + self.attention


def qlora_shape(model: Any, seq_len: int, checkpointing: bool | None = None) -> QLoraShape:
    """From a (peft-wrapped) causal LM: linear layers at in x out, whatever their storage."""
    sizes = [("lora_" in name, int(m.in_features) * int(m.out_features))
             for name, m in _leaf_linears(model)]
    adapters = sum(n for lora, n in sizes if lora)
    frozen = sum(n for lora, n in sizes if not lora)
    if checkpointing is None:  # transformers 5 renamed the flag; a plain module may have either
        checkpointing = bool(next((getattr(model, a) for a in (
            "is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(model, a)),
            False))
    shape = ModelShape(frozen + adapters, *depth_width(model.config), seq_len,
                       f"{type(model).__name__} (nf4 + LoRA)")
    return QLoraShape(shape, frozen, adapters, checkpointing)


def _leaf_linears(model: Any) -> Iterator[tuple[str, Any]]:
    """Linear layers that compute: a peft LoRA wrapper's base layer, not the wrapper."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not any(
                isinstance(c, torch.nn.Linear) for c in module.children()):
            yield name, module


@contextlib.contextmanager
def tally(model: Any) -> Iterator[tuple[collections.Counter[str], collections.Counter[str]]]:
    """While open, (parts, by precision): each linear call's forward and gradient FLOPs."""
    parts: collections.Counter[str] = collections.Counter()
    by_dtype: collections.Counter[str] = collections.Counter()

    def hook(module: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x = inputs[0]
        flops = 2 * (x.numel() // module.in_features) * module.in_features * module.out_features
        four_bit = type(module).__name__ == "Linear4bit"  # its matmul: bitsandbytes' dtype
        precision = _dtype((getattr(module, "compute_dtype", None) or x.dtype) if four_bit
                           else module.weight.dtype)
        parts.update({"forward": flops, "forward_4bit": flops * four_bit})
        by_dtype[precision] += flops
        if output.requires_grad:
            grads = {"input_grads": x.requires_grad, "weight_grads": module.weight.requires_grad}

            def backward(_: Any) -> None:
                for part, needed in grads.items():
                    parts[part] += flops * needed
                    by_dtype[precision] += flops * needed

            output.register_hook(backward)

    handles = [m.register_forward_hook(hook) for _, m in _leaf_linears(model)]
    try:
        yield parts, by_dtype
    finally:
        for h in handles:
            h.remove()


def count_step(model: Any, batch_size: int, seq_len: int, seed: int = 0) -> tuple[float, Executed]:
    """(FlopCounterMode's, executed) FLOPs per token of one forward + backward of random ids."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    device = next(p.device for p in model.parameters())
    ids = torch.randint(4, model.config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    x, y = ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
    with tally(model) as (parts, by_dtype):
        counted = count_flops(model, x, y)
    q, tokens = qlora_shape(model, seq_len), x.numel()
    attention = q.shape.attention_flops(recompute=q.checkpointing)
    precisions = {k: v / tokens for k, v in by_dtype.items()}
    hidden = _dtype(model.get_input_embeddings().weight.dtype)  # attention's precision
    precisions[hidden] = precisions.get(hidden, 0.0) + attention
    return counted / tokens, Executed(
        *(parts[k] / tokens for k in ("forward", "input_grads", "weight_grads")), attention,
        parts["forward_4bit"] / tokens, tuple(sorted(precisions.items())))


def qlora_check(qshape: QLoraShape, executed: Executed, counted_per_token: float) -> pd.DataFrame:
    """Per token: model FLOPs, executed, the counter, the counter + the 4-bit forward (flagged)."""
    run, seen = executed.total, counted_per_token + executed.forward_4bit
    why = ("the counter with the 4-bit forward added back sees less than the tally: a matmul "
           "kernel it has no formula for" if seen < run else
           "the counter sees matmuls the tally missed: a layer that is not an nn.Linear")
    flagged, note = disagreement(run, seen, why, against="executed")
    rows = [(f"model FLOPs {qshape.formula}", qshape.flops_per_token, False,
             f"counts the frozen base's weight gradients ({2 * qshape.frozen:.4g} FLOPs per "
             "token), which a QLoRA step never computes"),
            (EXECUTED, run, False,
             f"forward {executed.forward:.4g}, input gradients {executed.input_grads:.4g}, LoRA "
             f"weight gradients {executed.weight_grads:.4g}, attention {executed.attention:.4g}"),
            ("FlopCounterMode, one step", counted_per_token, False,
             "sees no bitsandbytes 4-bit forward (a custom op with no FLOP formula)"),
            ("FlopCounterMode + the 4-bit forward from the Linear4bit shapes", seen, flagged,
             note)]
    return pd.DataFrame([{"method": m, "flops_per_token": v, "vs_executed": v / run if run else
                          math.nan, "flagged": flag, "note": n, "params": qshape.shape.params,
                          "frozen": qshape.frozen, "adapters": qshape.adapters,
                          "checkpointing": qshape.checkpointing}
                         for m, v, flag, n in rows])


def step_peak(executed: Executed, device: Any, probe_size: int = 1024,
              known: dict[str, Peak] | None = None) -> Peak:
    """The step's peak: total / sum(FLOPs_p / peak_p) over its precisions; `known` caches them."""
    import torch

    dev = resolve(device)
    fast_fp32 = dev.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    known = {} if known is None else known
    total, parts = sum(f for _, f in executed.by_dtype), []
    for precision, flops in executed.by_dtype:
        key = "tf32" if precision == "fp32" and fast_fp32 else precision
        peak = known[key] = known.get(key) or peak_flops(dev, key, probe_size=probe_size)
        if not peak.flops:
            return Peak(None, f"no {key} peak ({peak.label}), which {flops / total:.0%} "
                        "of the step's FLOPs ran in", peak.source, peak.measured, key)
        parts.append((key, flops, peak))
    said = "; ".join(f"{key} {flops / total:.0%} of the FLOPs at {peak.flops / 1e12:.4g} TFLOP/s "
                     f"({peak.label})" for key, flops, peak in parts)
    return Peak(total / sum(f / p.flops for _, f, p in parts),
                "the step's precisions weighted by their FLOPs: " + said, "step_peak",
                any(p.measured for *_, p in parts), "+".join(p for p, _ in executed.by_dtype),
                max(p.spread for *_, p in parts))


@dataclass(frozen=True)
class Counted:
    """One plan's step, counted on the job's model as that plan loads it."""

    qshape: QLoraShape
    executed: Executed
    counter: float  # FlopCounterMode's FLOPs per token
    peak: Peak  # step_peak's


def count_plans(cfg: Any, plans: Iterable[Any], src: Any, bases: Any, device: Any
                ) -> dict[str, Counted]:
    """Each plan's step counted once, untimed, on one row, on its base (diag.qlora.base.Bases)."""
    known, out = {}, {}
    for plan in plans:
        model = bases.load(cfg, plan, src, device, StageTimer())[1]  # its clock: thrown away
        try:
            model.train()
            counter, executed = count_step(model, 1, cfg.seq_len, cfg.seed)
            out[plan.name] = Counted(qlora_shape(model, cfg.seq_len), executed, counter,
                                     step_peak(executed, device, known=known))
        finally:
            bases.release()
    return out


def plan_mfu(plan: str, seconds: float, token_slots: float, qshape: QLoraShape,
             executed: Executed, counted: float, peak: Peak) -> list[dict[str, Any]]:
    """MFU of token_slots in `seconds` by executed and by model FLOPs against `peak`."""
    rate = token_slots / seconds if seconds > 0 else math.nan
    seen, rows = counted + executed.forward_4bit, []
    for flops, per_token in ((EXECUTED, executed.total),
                             (f"model FLOPs {qshape.formula}", qshape.flops_per_token)):
        mfu, _, note = judge_mfu(rate, per_token, peak.flops, peak.label)
        rows.append({"plan": plan, "flops": flops, "flops_per_token": per_token,
                     "token_slots_per_s": rate, "achieved_tflops": rate * per_token / 1e12,
                     "peak_tflops": peak.flops / 1e12 if peak.flops else math.nan,
                     "peak_spread": peak.spread, "mfu": mfu,
                     "counter_vs_flops": seen / per_token, "peak": note})
    return rows


def run_mfu(frame: pd.DataFrame, stages: pd.DataFrame, counted: dict[str, Counted]) -> pd.DataFrame:
    """plan_mfu of each counted plan's steady steps per token slot, against its peak x ranks."""
    rows = []
    for r in frame.itertuples():
        if r.plan not in counted:
            continue
        c = counted[r.plan]
        own = stages[(stages["run"] == r.plan) & stages["step"].notna()]
        own = own[own["rank"] == own["rank"].min()]  # ranks run side by side: one's clock
        peak = over_ranks(c.peak, r.ranks)
        slots = r.token_slots / r.steps * own["step"].nunique()
        # a measured CPU peak is per CPU second: the loop's CPU seconds
        cpu = c.peak.source == "step_peak" and c.peak.measured and "train_cpu_s" in frame
        seconds = float(r.train_cpu_s) if cpu else float(own["seconds"].sum())
        rows += plan_mfu(r.plan, seconds, slots, c.qshape, c.executed, c.counter, peak)
    return pd.DataFrame(rows)
