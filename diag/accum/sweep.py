"""The grad-accumulation sweep: the same tokens per optimizer step, split micro_batch x grad_accum.

Each point trains a fresh copy of the same causal LM for real (forward, backward, optimizer step,
zero_grad) on random windows of the token file: `warmup_steps` untimed steps first (allocator,
kernel choice, torch.compile: reported apart as `warmup_s`), then `steps` timed ones, one row
each (`repeat`). A point that runs out of memory is a row with status "oom" and the sweep goes
on. Read `tokens_per_s` and `seconds_per_step` against `floor_s` (the step at 100% of the peak).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from typing import TYPE_CHECKING, Any

from diag.accum.mfu import ModelShape, count_flops, floor_seconds, judge_mfu, loss_of
from diag.data import BatchLoader, check_tokens, ensure_tokens, token_file

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from diag.config import AccumConfig

COLUMNS = ["micro_batch", "grad_accum", "tokens_per_step", "seconds_per_step", "floor_s",
           "tokens_per_s", "data_s", "compute_s", "peak_mem_gb", "flops_per_token", "mfu",
           "status", "repeat", "warmup_s", "compile", "detail"]


def pairs(cfg: AccumConfig, world_size: int = 1) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) points, each making tokens_per_step over world_size DDP ranks:
    cfg.micro_batches in their order, else every power of two that divides the step, most
    accumulation first. A micro-batch the world cannot split the step by is a ValueError."""
    from diag.config.accum import check_divides

    sequences = cfg.tokens_per_step // cfg.seq_len
    per_rank = sequences // world_size
    micro = cfg.micro_batches or [1 << i for i in range(per_rank.bit_length())
                                  if sequences % (world_size << i) == 0]
    for m in micro:
        check_divides(cfg.tokens_per_step, cfg.seq_len, m, world_size,
                      field="AccumConfig.tokens_per_step")
    return [(m, per_rank // m) for m in dict.fromkeys(micro)]


def is_oom(err: BaseException) -> bool:
    """torch's CUDA OOM, Python's MemoryError, or the CPU allocator refusing a request."""
    import torch

    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text
                                              or "can't allocate memory" in text)


class PeakMemory:
    """Peak memory of one point: CUDA's allocator high-water mark, or on CPU the process's peak
    resident set (VmHWM, reset per point through /proc/self/clear_refs); NaN where unreadable."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before_gb = math.nan

    def reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before_gb = torch.cuda.memory_allocated(self.device) / 1e9
            return
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets the peak RSS, nothing else
        self.before_gb = self._status_gb("VmRSS:")

    def growth_gb(self) -> float:
        """What the work since reset() added at its peak: the step's own memory, not the
        interpreter's (CUDA: max allocated over allocated before; CPU: peak RSS over RSS)."""
        return self.gb() - self.before_gb

    @staticmethod
    def _status_gb(key: str) -> float:
        try:
            with open("/proc/self/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith(key))
        except (OSError, StopIteration):
            return math.nan
        return kb * 1024 / 1e9

    def gb(self) -> float:
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        return self._status_gb("VmHWM:")


def build_model(cfg: AccumConfig, device: torch.device) -> Any:
    """The embedded tiny Llama, or a GPT-2-small shape (nanoGPT's padded vocab), random init."""
    import torch

    if cfg.model == "tiny":
        from transformers import LlamaForCausalLM

        from diag.embedded import ensure_assets

        model = LlamaForCausalLM.from_pretrained(ensure_assets().model_dir,
                                                 attn_implementation="sdpa", dtype=torch.float32)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=50304, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                            attn_implementation="sdpa")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = GPT2LMHeadModel(config)
    context = getattr(model.config, "max_position_embeddings", None) or model.config.n_positions
    if cfg.seq_len > context:
        raise ValueError(f"AccumConfig.seq_len={cfg.seq_len}: above the context of model "
                         f"{cfg.model!r} ({context} positions); allowed 1..{context}")
    return model.to(device).train()


def _autocast(cfg: AccumConfig, device: torch.device) -> Any:
    import torch

    dtype = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if dtype == "fp32":
        return contextlib.nullcontext(), "fp32"
    return torch.autocast(device.type, dtype=torch.bfloat16), "bf16"


def _tokens(cfg: AccumConfig) -> Any:
    return token_file(cfg.token_file) if cfg.token_file else ensure_tokens()


def sweep_grad_accum(cfg: AccumConfig | None = None) -> pd.DataFrame:
    """One row per timed optimizer step per point (an OOM point: one row); see COLUMNS."""
    from diag.config import AccumConfig

    return measure(cfg or AccumConfig.default())[0]


def measure(cfg: AccumConfig) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The sweep frame, and what it was measured with: `shape` (ModelShape), `peak`
    (diag.machine.device.Peak), `counted_per_token` (FlopCounterMode on one micro-step), `amp`."""
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from diag.machine import device as devices

    from diag.timing.distributed import init_group, root_first

    dev = devices.resolve(cfg.device)
    seat = init_group(dev.type)  # under torchrun / accelerate: one DDP rank of the sweep
    if seat.distributed and dev.type == "cuda":
        dev = torch.device("cuda", seat.local_rank)
    points = pairs(cfg, seat.world_size)  # before any work: a world that cannot split the step
    with root_first():  # rank 0 tokenizes the synthetic set once; the others read its file
        tokens = _tokens(cfg)
    model = build_model(cfg, dev)
    check_tokens(tokens, model.config.vocab_size)  # before any step: a bad id fails here, named
    # the reset copy lives in host memory: on the device it would count in every point's peak
    # memory (a model's worth too much, enough to call a point that fits "oom")
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    amp, amp_dtype = _autocast(cfg, dev)
    shape = ModelShape.from_model(model, cfg.seq_len, cfg.model)
    fpt = shape.flops_per_token
    if cfg.peak_tflops:
        peak = devices.Peak(cfg.peak_tflops * 1e12, f"given: {cfg.peak_tflops:g} TFLOP/s "
                            "(AccumConfig.peak_tflops)", "config", False)
    else:
        peak = devices.peak_flops(dev, "bf16" if amp_dtype == "bf16" else "fp32")
    if seat.distributed and peak.flops:  # the step is spread over the ranks: their peaks add up
        peak = devices.Peak(peak.flops * seat.world_size,
                            f"{seat.world_size} x {peak.label}", peak.source, peak.measured)
    # the formula checked against what torch counts, on one micro-step of the smallest point
    smallest = min(m for m, _ in points)
    with BatchLoader(tokens, smallest, cfg.seq_len, dev, seed=cfg.seed, prefetch=False) as bl:
        x, y = bl.next()
        try:
            counted = count_flops(model, x, y, amp) / x.numel()
        except (RuntimeError, MemoryError) as err:
            if not is_oom(err):
                raise
            counted = math.nan  # even one micro-step does not fit: every point will say so
            model.zero_grad(set_to_none=True)
    info = {"shape": shape, "peak": peak, "counted_per_token": counted,
            "amp": amp_dtype, "device": str(dev), "world_size": seat.world_size}
    step_model = model
    if seat.distributed:  # gradients all-reduced once per optimizer step, as a DDP job does
        step_model = torch.nn.parallel.DistributedDataParallel(model)
    memory = PeakMemory(dev)
    rows: list[dict[str, Any]] = []
    for micro, accum in tqdm(points, desc="accum sweep", unit="point", leave=False):
        model.load_state_dict(initial)  # every point starts from the same weights
        base = {"micro_batch": micro, "grad_accum": accum, "tokens_per_step": cfg.tokens_per_step,
                "floor_s": floor_seconds(fpt, cfg.tokens_per_step, peak.flops),
                "flops_per_token": fpt, "compile": cfg.compile}
        memory.reset()
        try:
            warmup_s, timed = _train_point(cfg, step_model, tokens, micro, accum, dev, amp,
                                           seed=cfg.seed + seat.rank)
        except (RuntimeError, MemoryError) as err:
            if not is_oom(err):
                raise
            model.zero_grad(set_to_none=True)
            rows.append({**base, "status": "oom", "repeat": 0, "peak_mem_gb": memory.gb(),
                         "detail": f"out of memory: {' '.join(str(err).split())[:160]}"})
            continue
        finally:
            gc.collect()  # the failed point's activations go before the next point allocates
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        peak_gb = memory.gb()
        for repeat, (seconds, data_s) in enumerate(timed):
            tps = cfg.tokens_per_step / seconds
            mfu, _, note = judge_mfu(tps, fpt, peak.flops, peak.label)
            rows.append({**base, "seconds_per_step": seconds, "tokens_per_s": tps,
                         "data_s": data_s, "compute_s": seconds - data_s, "peak_mem_gb": peak_gb,
                         "mfu": mfu, "status": "ok", "repeat": repeat, "warmup_s": warmup_s,
                         # the peak is named once, in the mfu frame; a row says why it has no MFU
                         "detail": "" if mfu == mfu else note})
    return pd.DataFrame(rows, columns=COLUMNS).astype({"compile": bool}), info


def _train_point(cfg: AccumConfig, model: Any, tokens: Any, micro: int, accum: int,
                 dev: torch.device, amp: Any, seed: int = 0
                 ) -> tuple[float, list[tuple[float, float]]]:
    """(warm-up seconds, [(step seconds, data seconds)] of the timed steps) for one point."""
    import torch

    from diag.machine.device import sync

    fused = {"fused": True} if dev.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, **fused)
    step_model = model
    if cfg.compile:
        torch._dynamo.reset()  # a fresh compile per point, so warmup_s holds its own compile
        step_model = torch.compile(model, dynamic=False)
    timed: list[tuple[float, float]] = []
    with BatchLoader(tokens, micro, cfg.seq_len, dev, seed=seed) as loader:  # a rank's own
        sync(dev)  # note: sync point: the clock starts on an idle device
        start = time.perf_counter()
        for _ in range(cfg.warmup_steps):
            _step(step_model, optimizer, loader, accum, amp)
        sync(dev)  # note: sync point: warm-up (and compile) kernels are billed to warm-up
        warmup_s = time.perf_counter() - start
        for _ in range(cfg.steps):
            t0 = time.perf_counter()
            data_s = _step(step_model, optimizer, loader, accum, amp)
            sync(dev)  # note: sync point: the step's queued kernels finish inside its time
            timed.append((time.perf_counter() - t0, data_s))
    del optimizer
    return warmup_s, timed


def _step(model: Any, optimizer: Any, loader: BatchLoader, accum: int, amp: Any) -> float:
    """One optimizer step of `accum` micro-steps; returns the seconds blocked on batches.

    No sync inside: on CUDA the host queues micro-step after micro-step while the device runs,
    and the prefetched batch's copy is queued behind them (`data_s` is host time spent waiting).
    """
    data_s = 0.0
    for i in range(accum):
        t = time.perf_counter()
        x, y = loader.next()
        data_s += time.perf_counter() - t
        # DDP: only the last micro-step all-reduces; the others accumulate locally
        quiet = model.no_sync() if i < accum - 1 and hasattr(model, "no_sync") \
            else contextlib.nullcontext()
        with quiet:
            with amp:
                loss = loss_of(model, x, y) / accum  # the mean over the whole step's tokens
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return data_s
