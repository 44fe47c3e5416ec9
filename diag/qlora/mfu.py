"""The QLoRA step's FLOPs and MFU, counted two ways and both named.

`executed`: what a step runs, tallied per call of each linear layer (hooks on the 4-bit base,
the LoRA adapters, the head): the forward (again where checkpointing recomputes), the input
gradients that backward computes (not for an input that needs none: the first layer's, unless
checkpointing makes the embeddings require grad), the LoRA weight gradients (the frozen base
computes none), plus attention's 4·L·d·T forward and 8·L·d·T backward per token (the full T x T
the math SDPA backend runs; a causal fused kernel may skip masked blocks). The model-FLOPs
convention, 6N + 12·L·d·T (8N + 16·L·d·T checkpointing), counts the frozen base's weight
gradients a QLoRA step never computes: shown beside it, not as it. `count_step` checks executed
against torch's FlopCounterMode on the same step, with what the counter cannot see added back:
bitsandbytes' 4-bit forward (a custom op), counted from the Linear4bit shapes. MFU divides by
the peak of the precisions the matmuls ran in, weighted by their FLOPs (`step_peak`).
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diag.accum import ModelShape, count_flops, disagreement, judge_mfu

if TYPE_CHECKING:
    import pandas as pd

    from diag.machine.device import Peak

# the two FLOP counts, as every table and the report name them
EXECUTED = "executed (fwd + input grads + LoRA grads + attention)"


@dataclass(frozen=True)
class QLoraShape:
    """The model-FLOPs formula's inputs for a 4-bit base with LoRA adapters."""

    shape: ModelShape  # params = every matmul weight (base at in x out, adapters, head)
    frozen: int  # the base's matmul weights: no weight gradient is computed for them
    adapters: int  # the LoRA weights (trained)
    checkpointing: bool

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per token: 6N (8N checkpointing) + the attention term."""
        return self.shape.training_flops(recompute=self.checkpointing)

    @property
    def formula(self) -> str:
        return "8N + 16·L·d·T" if self.checkpointing else "6N + 12·L·d·T"


@dataclass(frozen=True)
class Executed:
    """FLOPs per token one step ran, by part, and by the precision each matmul ran in."""

    forward: float  # every linear layer's forward, a recomputed one twice
    input_grads: float  # backward to the inputs that require a gradient
    weight_grads: float  # the LoRA weights' (nothing else trains)
    attention: float  # QK^T and AV, forward (twice recomputing) and backward
    forward_4bit: float  # of `forward`: bitsandbytes' 4-bit matmuls (FlopCounterMode sees none)
    by_dtype: tuple[tuple[str, float], ...]  # (precision, FLOPs per token), attention included

    @property
    def total(self) -> float:
        return self.forward + self.input_grads + self.weight_grads + self.attention


def qlora_shape(model: Any, seq_len: int, checkpointing: bool | None = None) -> QLoraShape:
    """From a (peft-wrapped) causal LM: linear layers at in x out, whatever their storage (a
    Params4bit holds two weights per byte, so numel() would halve them)."""
    frozen = adapters = 0
    for name, module in _leaf_linears(model):
        n = int(module.in_features) * int(module.out_features)
        if "lora_" in name:
            adapters += n
        else:
            frozen += n
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if checkpointing is None:
        # transformers 5 renamed the flag (the old name warns); a plain module may have either
        checkpointing = bool(next((getattr(model, a) for a in (
            "is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(model, a)),
            False))
    shape = ModelShape(frozen + adapters, config.num_hidden_layers, heads * head_dim, seq_len,
                       f"{type(model).__name__} (nf4 + LoRA)")
    return QLoraShape(shape, frozen, adapters, checkpointing)


def _leaf_linears(model: Any) -> Iterator[tuple[str, Any]]:
    """Linear layers that compute (a peft LoRA wrapper holds its base layer as a child: that
    one is counted, the wrapper is not)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not any(
                isinstance(c, torch.nn.Linear) for c in module.children()):
            yield name, module


def _precision(module: Any, x: Any) -> str:
    """The precision a linear layer's matmul runs in: bitsandbytes' compute dtype for a 4-bit
    layer (it casts its input to it), else its weight's."""
    from diag.machine.gpus import _dtype

    if type(module).__name__ == "Linear4bit":
        return _dtype(getattr(module, "compute_dtype", None) or x.dtype)
    return _dtype(module.weight.dtype)


@contextlib.contextmanager
def tally(model: Any) -> Iterator[collections.Counter[str]]:
    """While open, every linear layer's call adds its FLOPs: 2 x rows x in x out to `forward`
    (and `forward_4bit` for a Linear4bit), and, when backward reaches its output, the same again
    to `input_grads` if its input requires grad and to `weight_grads` if its weight does; each
    also under its precision. A recomputed forward's output gets no gradient: counted once."""
    got: collections.Counter[str] = collections.Counter()

    def hook(module: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x = inputs[0]
        flops = 2 * (x.numel() // module.in_features) * module.in_features * module.out_features
        precision = _precision(module, x)
        got["forward"] += flops
        got[precision] += flops
        if type(module).__name__ == "Linear4bit":
            got["forward_4bit"] += flops
        if output.requires_grad:
            grads = {"input_grads": x.requires_grad, "weight_grads": module.weight.requires_grad}

            def backward(_: Any) -> None:
                for part, needed in grads.items():
                    got[part] += flops * needed
                    got[precision] += flops * needed

            output.register_hook(backward)

    handles = [m.register_forward_hook(hook) for _, m in _leaf_linears(model)]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def count_step(model: Any, batch_size: int, seq_len: int, seed: int = 0
               ) -> tuple[float, Executed]:
    """One forward + backward of random ids, counted both ways at once: (FlopCounterMode's
    FLOPs per token, the math SDPA backend forced on CPU where the fused kernel would count 0;
    the step's executed FLOPs per token, from `tally` and the attention term)."""
    import torch

    from diag.machine.gpus import _dtype

    gen = torch.Generator().manual_seed(seed)
    device = next(p.device for p in model.parameters())
    ids = torch.randint(4, model.config.vocab_size, (batch_size, seq_len + 1), generator=gen)
    ids = ids.to(device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    with tally(model) as got:
        counted = count_flops(model, x, y)
    tokens = x.numel()
    q = qlora_shape(model, seq_len)
    attention = q.shape.attention_flops(recompute=q.checkpointing)
    # attention runs on the hidden states, in the embeddings' precision
    hidden = _dtype(model.get_input_embeddings().weight.dtype)
    precisions = {k: v / tokens for k, v in got.items()
                  if k not in ("forward", "forward_4bit", "input_grads", "weight_grads")}
    precisions[hidden] = precisions.get(hidden, 0.0) + attention
    return counted / tokens, Executed(
        got["forward"] / tokens, got["input_grads"] / tokens, got["weight_grads"] / tokens,
        attention, got["forward_4bit"] / tokens, tuple(sorted(precisions.items())))


def mfu_check(qshape: QLoraShape, executed: Executed, counted_per_token: float) -> pd.DataFrame:
    """Model FLOPs, executed, the counter and the counter with the 4-bit forward added back,
    per token, side by side; the last against executed flagged past MFU_DISAGREEMENT."""
    import pandas as pd

    run = executed.total
    seen = counted_per_token + executed.forward_4bit
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
    """The peak of the precisions the step's FLOPs ran in: each one's peak (a repeated probe on
    CPU, the dense table on CUDA; fp32 matmuls at the tf32 rate where torch allows it), combined
    as the step at 100% of each would run: total / sum(FLOPs_p / peak_p). known: peaks already
    measured, by precision (filled here), so plans of one run share one probe."""
    import torch

    from diag.machine.device import Peak, peak_flops, resolve

    dev = resolve(device)
    fast_fp32 = dev.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    known = {} if known is None else known
    total = sum(f for _, f in executed.by_dtype)
    seconds, said, spreads, measured = 0.0, [], [], False
    for precision, flops in executed.by_dtype:
        key = "tf32" if precision == "fp32" and fast_fp32 else precision
        if key not in known:
            known[key] = peak_flops(dev, key, probe_size=probe_size)
        peak = known[key]
        if not peak.flops:
            return Peak(None, f"no {key} peak ({peak.label}), which {flops / total:.0%} "
                        "of the step's FLOPs ran in", peak.source, peak.measured, key)
        seconds += flops / peak.flops
        spreads.append(peak.spread)
        measured |= peak.measured
        said.append(f"{key} {flops / total:.0%} of the FLOPs at "
                    f"{peak.flops / 1e12:.4g} TFLOP/s ({peak.label})")
    label = "the step's precisions weighted by their FLOPs: " + "; ".join(said)
    return Peak(total / seconds, label, "step_peak", measured, "+".join(
        p for p, _ in executed.by_dtype), max(spreads, default=0.0))


@dataclass(frozen=True)
class Counted:
    """One plan's step, counted on the job's model as that plan loads it."""

    qshape: QLoraShape
    executed: Executed
    counter: float  # FlopCounterMode's FLOPs per token
    peak: Peak  # of the step's precisions (step_peak)


def count_plans(cfg: Any, plans: Iterable[Any], src: Any, bases: Any) -> dict[str, Counted]:
    """Each plan's step counted once, untimed, one row of cfg.seq_len tokens: on the base its
    rounds ran (bases: diag.qlora.base.Bases), a fresh adapter on it, taken off after."""
    import torch

    from diag.machine.device import resolve
    from diag.timing import StageTimer
    from diag.timing.distributed import place

    device, known, out = resolve(cfg.device), {}, {}
    if place().distributed and device.type == "cuda":  # each rank's model on its own GPU
        device = torch.device("cuda", place().local_rank)
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
    """Two rows for one plan's steady steps (token_slots run in `seconds`): its MFU by executed
    FLOPs and by model FLOPs, both against `peak`; the counter's check beside executed."""
    rate = token_slots / seconds if seconds > 0 else math.nan
    seen = counted + executed.forward_4bit
    rows = []
    for flops, per_token in ((EXECUTED, executed.total),
                             (f"model FLOPs {qshape.formula}", qshape.flops_per_token)):
        mfu, _, note = judge_mfu(rate, per_token, peak.flops, peak.label)
        rows.append({"plan": plan, "flops": flops, "flops_per_token": per_token,
                     "token_slots_per_s": rate, "achieved_tflops": rate * per_token / 1e12,
                     "peak_tflops": peak.flops / 1e12 if peak.flops else math.nan,
                     "peak_spread": peak.spread, "mfu": mfu,
                     "counter_vs_flops": seen / per_token, "peak": note})
    return rows


def run_mfu(frame: pd.DataFrame, stages: pd.DataFrame, counted: dict[str, Counted]
            ) -> pd.DataFrame:
    """Per plan two rows: its steady steps' MFU by executed FLOPs and by model FLOPs, both per
    token slot (padding runs too) against the step's peak (x the ranks under DDP), and the
    counter (+ the 4-bit forward) over each FLOP count."""
    import dataclasses

    import pandas as pd

    rows = []
    for r in frame.itertuples():
        if r.plan not in counted:
            continue
        c = counted[r.plan]
        own = stages[(stages["run"] == r.plan) & stages["step"].notna()]
        own = own[own["rank"] == own["rank"].min()]  # one rank's clock: ranks run side by side
        peak = c.peak if r.ranks <= 1 or not c.peak.flops else dataclasses.replace(
            c.peak, flops=c.peak.flops * r.ranks, label=f"{r.ranks} x {c.peak.label}")
        slots = r.token_slots / r.steps * own["step"].nunique()
        # a CPU peak is per CPU second (the probe's clock): the steady loop's CPU seconds
        cpu = c.peak.source == "step_peak" and c.peak.measured and "train_cpu_s" in frame
        seconds = float(r.train_cpu_s) if cpu else float(own["seconds"].sum())
        rows += plan_mfu(r.plan, seconds, slots, c.qshape, c.executed, c.counter, peak)
    return pd.DataFrame(rows)


def mfu_of_model(model: Any, seq_len: int, batch_size: int = 1,
                 checkpointing: bool | None = None) -> pd.DataFrame:
    """The check on a loaded model: its shape, one counted step, the table."""
    qshape = qlora_shape(model, seq_len, checkpointing)
    counted, executed = count_step(model, batch_size, seq_len)
    return mfu_check(qshape, executed, counted)
