"""Model FLOPs per token: 6N + 12·L·d·T (PaLM, appendix B; 8N + 16·L·d·T recomputing), checked
against torch's FlopCounterMode; the floor; MFU, where above 100% is a flag, never a result."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from diag.decision import MFU_DISAGREEMENT
from diag.machine.device import Peak, dense_peak_flops, find_gpu

if TYPE_CHECKING:
    import torch

NANOGPT_PEAK = 312e12  # nanoGPT's estimate_mfu divides by this whatever the GPU (A100 dense bf16)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP formula needs from a model."""

    params: int  # N: weights in matmuls (linear layers + LM head; not embedding lookups)
    layers: int  # L: transformer blocks
    d_model: int  # d: attention width, heads x head_dim
    seq_len: int  # T: tokens per sequence
    name: str = ""

    @property
    def flops_per_token(self) -> float:
        return self.training_flops(recompute=False)

    def training_flops(self, recompute: bool = False) -> float:
        """FLOPs per trained token: 6N + attention, 8N recomputing (the forward runs twice)."""
        return (8.0 if recompute else 6.0) * self.params + self.attention_flops(recompute)

    def attention_flops(self, recompute: bool = False) -> float:
        """QK^T and AV per token: 4·L·d·T forward (twice recomputing), 8·L·d·T backward."""
        return (16.0 if recompute else 12.0) * self.layers * self.d_model * self.seq_len

    @classmethod
    def from_model(cls, model: Any, seq_len: int, name: str = "") -> ModelShape:
        """From a transformers causal LM; a tied input embedding counts once, as the LM head."""
        import torch

        out = model.get_output_embeddings()
        head = out.weight if out is not None else None
        lookups = {id(m.weight) for m in model.modules()
                   if isinstance(m, torch.nn.Embedding) and m.weight is not head}
        # parameters() yields a tied tensor once
        params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
        return cls(params, *depth_width(model.config), seq_len, name or type(model).__name__)

    @classmethod
    def named(cls, name: str, seq_len: int = 1024) -> ModelShape:
        """A known shape, counted on the meta device (no memory): 'gpt2-small' (124M)."""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        shapes = {"gpt2-small": GPT2Config(n_layer=12, n_head=12, n_embd=768),
                  "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024)}
        if name not in shapes:
            raise ValueError(f"name={name!r}: allowed values are " + ", ".join(map(repr, shapes)))
        with torch.device("meta"):
            model = GPT2LMHeadModel(shapes[name])
        return cls.from_model(model, seq_len, name)


def depth_width(c: Any) -> tuple[int, int]:
    """(L, d) of a transformers config, Llama's names or GPT-2's: blocks, heads x head_dim."""
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    return getattr(c, "num_hidden_layers", None) or c.n_layer, heads * head_dim


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of one micro-batch (y: x's windows shifted by one)."""
    import torch.nn.functional as F

    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def count_flops(model: Any, x: torch.Tensor, y: torch.Tensor, autocast: Any = None) -> int:
    """FLOPs FlopCounterMode sees in one forward + backward of (x, y); gradients are cleared."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    # CPU's fused SDPA kernel has no FLOP formula (it would count 0); the math path is matmuls
    backend = sdpa_kernel(SDPBackend.MATH) if x.device.type == "cpu" else contextlib.nullcontext()
    counter = FlopCounterMode(display=False)
    with backend, counter:
        with autocast or contextlib.nullcontext():
            loss = loss_of(model, x, y)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def disagreement(formula: float, counted: float, explained: str = "",
                 against: str = "the formula") -> tuple[bool, str]:
    """(flagged, note): counted FLOPs against `formula`, flagged past MFU_DISAGREEMENT."""
    if not (formula > 0 and math.isfinite(counted)):
        return True, f"no comparison: formula {formula:.4g}, counter {counted:.4g} FLOPs"
    ratio = counted / formula
    off = abs(ratio - 1.0) > MFU_DISAGREEMENT
    note = f"counter {ratio:.3g}x {against} ({'over' if off else 'within'} {MFU_DISAGREEMENT:.0%})"
    return off, note + (f": {explained}" if off and explained else "")


def over_ranks(peak: Peak, ranks: int) -> Peak:
    """The peak of a step spread over `ranks` (DDP): the ranks' peaks add up."""
    return peak if ranks <= 1 or not peak.flops else dataclasses.replace(
        peak, flops=peak.flops * ranks, label=f"{ranks} x {peak.label}")


def floor_impossible(floor_s: float, seconds_per_step: float) -> bool:
    """A floor above the measured step: the peak is too low or the FLOPs over-counted."""
    return bool(math.isfinite(floor_s) and math.isfinite(seconds_per_step)
                and floor_s > seconds_per_step)


def floor_seconds(flops_per_token: float, tokens: float, peak_flops: float | None) -> float:
    """Seconds `tokens` take at 100% of the peak (NaN without one): no run is faster."""
    ok = bool(peak_flops) and math.isfinite(peak_flops)
    return flops_per_token * tokens / peak_flops if ok else math.nan


def judge_mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None,
              peak_label: str) -> tuple[float, float, str]:
    """(mfu, ratio to the peak, note): mfu is NaN when the peak is unknown or the ratio > 1."""
    if peak_flops is None or not peak_flops > 0:
        return math.nan, math.nan, f"no MFU: {peak_label}"
    ratio = tokens_per_s * flops_per_token / peak_flops
    if ratio > 1.0:
        return math.nan, ratio, (
            f"not an MFU: {ratio:.0%} of the peak is impossible; the peak "
            f"({peak_flops / 1e12:.4g} TFLOP/s, {peak_label}) is wrong for this device, or "
            f"{flops_per_token:.4g} FLOPs per token is over-counted (achieved "
            f"{tokens_per_s * flops_per_token / 1e12:.4g} TFLOP/s)")
    return ratio, ratio, f"against {peak_label}"


def mfu_from_figures(tokens_per_s: float, shape: ModelShape, device: str, dtype: str = "bf16",
                     assumed_peak: float | None = NANOGPT_PEAK,
                     tokens_per_step: int | None = None) -> pd.DataFrame:
    """Your run's MFU against diag's dense peak for `device` and against `assumed_peak`."""
    if not tokens_per_s > 0:
        raise ValueError(f"tokens_per_s={tokens_per_s!r}: must be > 0")
    spec, table = find_gpu(device), dense_peak_flops(device, dtype)
    peaks = [("diag table", table, f"unknown device {device!r}: diag has no dense {dtype} peak "
              "for it; give the datasheet's dense (not 2:4-sparse) figure as assumed_peak"
              if spec is None else f"{spec.name} has no {dtype} tensor-core figure in diag's "
              "table" if table is None else f"diag table: {spec.name} dense {dtype} "
              f"({spec.source})")]
    if assumed_peak:
        note = " (nanoGPT's hard-coded A100 bf16)" if assumed_peak == NANOGPT_PEAK else ""
        peaks.append(("assumed", assumed_peak, f"assumed {assumed_peak / 1e12:.4g} TFLOP/s{note}"))
    fpt, rows = shape.flops_per_token, []
    for name, peak, label in peaks:
        mfu, ratio, verdict = judge_mfu(tokens_per_s, fpt, peak, label)
        if name == "assumed" and table and peak and not math.isclose(peak, table, rel_tol=1e-3):
            verdict += (f"; and not this device's peak: {spec.name} does {table / 1e12:.4g} "
                        f"dense {dtype} TFLOP/s ({table / peak:.2f}x the assumed one), so the "
                        f"real MFU is {tokens_per_s * fpt / table:.1%}")
        rows.append({"peak": name, "peak_tflops": peak / 1e12 if peak else math.nan,
                     "achieved_tflops": tokens_per_s * fpt / 1e12, "ratio_to_peak": ratio,
                     "mfu": mfu, "flops_per_token": fpt, "verdict": verdict, **({
                         "seconds_per_step": tokens_per_step / tokens_per_s,
                         "floor_s": floor_seconds(fpt, tokens_per_step, peak)}
                         if tokens_per_step else {})})
    return pd.DataFrame(rows)
