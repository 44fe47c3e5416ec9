"""The QLoRA step's MFU: the formula (diag.accum.mfu's) on the nf4 base + LoRA, checked by
FlopCounterMode on one real step, every gap explained or flagged.

The formula counts model FLOPs the usual way: 6N per token + 12·L·d·T for attention, 8N +
16·L·d·T with activation checkpointing (the forward again), N = every weight in a matmul (the
4-bit base's linear layers counted at their logical in x out, the LoRA adapters, the LM head).
A QLoRA step executes less: the frozen base computes no weight gradient (2 N_frozen per token),
so the counter is compared with `executed` = formula - 2·N_frozen. Where the counter sees
less still, bitsandbytes' 4-bit matmuls ran as kernels with no FLOP formula (invisible to it);
a gap over MFU_DISAGREEMENT is flagged with that explanation, never hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diag.accum import ModelShape, count_flops, disagreement, judge_mfu

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class QLoraShape:
    """The formula's inputs for a 4-bit base with LoRA adapters."""

    shape: ModelShape  # params = every matmul weight (base at in x out, adapters, head)
    frozen: int  # the base's matmul weights: no weight gradient is computed for them
    adapters: int  # the LoRA weights (trained)
    checkpointing: bool

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per trained token: 6N (8N checkpointing) + the attention term."""
        return self.shape.training_flops(recompute=self.checkpointing)

    @property
    def executed_per_token(self) -> float:
        """What a QLoRA step runs: the formula less the frozen base's weight gradients."""
        return self.flops_per_token - 2.0 * self.frozen


def qlora_shape(model: Any, seq_len: int, checkpointing: bool | None = None) -> QLoraShape:
    """From a (peft-wrapped) causal LM: linear layers at in x out, whatever their storage (a
    Params4bit holds two weights per byte, so numel() would halve them)."""
    import torch

    frozen = adapters = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        n = int(module.in_features) * int(module.out_features)
        if "lora_" in name:
            adapters += n
        elif not any(isinstance(c, torch.nn.Linear) for c in module.children()):
            frozen += n  # a peft LoRA wrapper holds its base layer as a child: counted there
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if checkpointing is None:
        checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    shape = ModelShape(frozen + adapters, config.num_hidden_layers, heads * head_dim, seq_len,
                       f"{type(model).__name__} (nf4 + LoRA)")
    return QLoraShape(shape, frozen, adapters, checkpointing)


def count_step(model: Any, batch_size: int, seq_len: int, seed: int = 0) -> float:
    """FlopCounterMode's FLOPs per token over one forward + backward of random ids (the math
    SDPA backend forced on CPU, where the fused kernel would count 0)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    device = next(p.device for p in model.parameters())
    ids = torch.randint(4, model.config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    ids = ids.to(device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return count_flops(model, x, y) / x.numel()


def mfu_check(qshape: QLoraShape, counted_per_token: float) -> pd.DataFrame:
    """Formula, executed and counted FLOPs per token side by side; the counter vs executed gap
    flagged past MFU_DISAGREEMENT, with the likely cause."""
    import pandas as pd

    executed = qshape.executed_per_token
    share = 2.0 * qshape.frozen / executed if executed else math.nan
    why = (f"bitsandbytes' 4-bit matmuls (the frozen base: its input gradients alone are "
           f"~{share:.0%} of the executed FLOPs) run in part as kernels FlopCounterMode has no "
           "formula for (dequantize + custom ops), so it sees less than the step runs"
           if counted_per_token < executed else
           "the counter sees more than the step should run: recomputation or a wrong N")
    flagged, note = disagreement(executed, counted_per_token, why, against="executed")
    f = "8N + 16·L·d·T" if qshape.checkpointing else "6N + 12·L·d·T"
    rows = [("formula " + f, qshape.flops_per_token, False, "model FLOPs, the MFU convention"),
            ("executed (formula - 2 N_frozen)", executed, False,
             (f"the frozen base computes no weight gradient: {2 * qshape.frozen:.4g} FLOPs "
              "per token less")),
            ("FlopCounterMode, one step", counted_per_token, flagged, note)]
    return pd.DataFrame([{"method": m, "flops_per_token": v,
                          "vs_formula": v / qshape.flops_per_token, "flagged": flag, "note": n,
                          "params": qshape.shape.params, "frozen": qshape.frozen,
                          "adapters": qshape.adapters, "checkpointing": qshape.checkpointing}
                         for m, v, flag, n in rows])


def qlora_mfu(tokens_per_s: float, qshape: QLoraShape, peak_flops: float | None,
              peak_label: str) -> tuple[float, str]:
    """(MFU, note) of trained tokens/s against the peak (NaN where unknown or impossible)."""
    mfu, _, note = judge_mfu(tokens_per_s, qshape.flops_per_token, peak_flops, peak_label)
    return mfu, note


def mfu_of_model(model: Any, seq_len: int, batch_size: int = 1,
                 checkpointing: bool | None = None) -> pd.DataFrame:
    """The check on a loaded model: its shape, one counted step, the table."""
    qshape = qlora_shape(model, seq_len, checkpointing)
    return mfu_check(qshape, count_step(model, batch_size, seq_len))
