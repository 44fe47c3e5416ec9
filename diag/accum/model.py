"""diag accum's causal LM as an AccumStep (the tiny Llama or a GPT-2-small shape, DDP under a
launcher), its FLOPs counted, and `measure(cfg)`: its sweep with diag.accum.sweep."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from diag.accum.sweep import accum_frame, is_oom, pairs, retime, train_points
from diag.config import AccumConfig
from diag.data import BatchLoader, check_tokens, ensure_tokens, token_file
from diag.machine import device as devices
from diag.machine.device import Peak
from diag.mfu import ModelShape, count_flops, floor_seconds, judge_mfu, loss_of, over_ranks
from diag.noise import unresolved
from diag.timing.distributed import init_group, root_first, spill_ranks
from diag.timing.harness import TimedStep

DECIDE_BUDGET_S = 60.0  # seconds one process may re-time the points its screen left within noise


@dataclass(frozen=True)
class Setup:
    """What the sweep was measured with (experiment.mfu_check reads it)."""

    shape: ModelShape
    peak: Peak  # the dense peak MFU is computed against
    counted_per_token: float  # FlopCounterMode on one micro-step of the smallest point
    amp: str  # autocast dtype: "bf16" or "fp32"
    device: str
    world_size: int  # DDP ranks the step is spread over


class LMStep:
    """diag accum's causal LM, trained a micro-step at a time (sweep.AccumStep)."""

    def __init__(self, cfg: AccumConfig, model: Any, tokens: Any, device: torch.device,
                 amp: Any, rank: int = 0, distributed: bool = False) -> None:
        self.model, self.device, self.amp = model, device, amp
        self._cfg, self._tokens, self._seed = cfg, tokens, cfg.seed + rank  # a rank's own windows
        self._slow_s = cfg.slow_ms / 1000 if rank == cfg.slow_rank else 0.0
        # the reset copy in host memory: on the device it would count in every point's peak
        self._initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self.ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else None
        self._ddp = self.ddp if self.ddp is not None else model
        self._run, self.optimizer = self._ddp, None

    def batches(self, micro_batch: int) -> Any:
        loader = BatchLoader(self._tokens, micro_batch, self._cfg.seq_len, self.device,
                             seed=self._seed)
        return _slowed(loader, self._slow_s) if self._slow_s else loader

    def reset(self) -> None:
        self.model.load_state_dict(self._initial)
        self.model.zero_grad(set_to_none=True)
        self.optimizer = None  # the last point's state goes before this point allocates
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self._ddp.parameters(), lr=3e-4, **fused)
        if self._cfg.compile:
            torch._dynamo.reset()  # a fresh compile per point, so warmup_s holds its own compile
            self._run = torch.compile(self._ddp, dynamic=False)

    def backward(self, batch: tuple[torch.Tensor, torch.Tensor], scale: float) -> None:
        with self.amp:
            loss = loss_of(self._run, *batch) * scale
        loss.backward()

    def no_sync(self) -> Any:
        return self._ddp.no_sync() if hasattr(self._ddp, "no_sync") else contextlib.nullcontext()

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _slowed(loader: BatchLoader, seconds: float) -> Iterator[Any]:
    with loader:
        yield (time.sleep(seconds) or batch for batch in loader)


def build_model(cfg: AccumConfig, device: torch.device) -> Any:
    """The embedded tiny Llama, or a GPT-2-small shape (nanoGPT's padded vocab), random init."""
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


def setup(cfg: AccumConfig) -> tuple[LMStep, Setup, list[tuple[int, int]]]:
    """cfg's model as a step on this rank, what it is measured with, and the points to sweep."""
    dev = devices.resolve(cfg.device)
    seat = init_group(dev.type)  # under a launcher: one DDP rank of the sweep
    if seat.distributed and dev.type == "cuda":
        dev = torch.device("cuda", seat.local_rank)
    points = pairs(cfg, seat.world_size)  # before any work: a world that cannot split the step
    with root_first():  # rank 0 tokenizes the synthetic set once; the others read its file
        tokens = token_file(cfg.token_file) if cfg.token_file else ensure_tokens()
    model = build_model(cfg, dev)
    check_tokens(tokens, model.config.vocab_size)  # before any step: a bad id fails here, named
    amp_dtype = cfg.dtype if cfg.dtype != "auto" else "bf16" if dev.type == "cuda" else "fp32"
    amp = contextlib.nullcontext() if amp_dtype == "fp32" else torch.autocast(
        dev.type, dtype=torch.bfloat16)
    peak = Peak(cfg.peak_tflops * 1e12, f"given: {cfg.peak_tflops:g} TFLOP/s (AccumConfig."
                "peak_tflops)", "config", False) if cfg.peak_tflops else devices.peak_flops(
        dev, amp_dtype)
    peak = over_ranks(peak, seat.world_size)  # the step is spread over the ranks
    smallest = min(m for m, _ in points)
    with BatchLoader(tokens, smallest, cfg.seq_len, dev, seed=cfg.seed, prefetch=False) as bl:
        x, y = bl.next()
        try:
            counted = count_flops(model, x, y, amp) / x.numel()
        except (RuntimeError, MemoryError) as err:
            if not is_oom(err):
                raise
            counted = math.nan  # not even one micro-step fits: every point will say so
            model.zero_grad(set_to_none=True)
    shape = ModelShape.from_model(model, cfg.seq_len, cfg.model)
    step = LMStep(cfg, model, tokens, dev, amp, seat.rank, seat.distributed)  # DDP after the count
    return step, Setup(shape, peak, counted, amp_dtype, str(dev), seat.world_size), points


def measure(cfg: AccumConfig) -> tuple[pd.DataFrame, Setup, TimedStep | None]:
    """The sweep frame (COLUMNS), its Setup, and under a launcher this rank's TimedStep."""
    step, got, points = setup(cfg)
    clock = TimedStep(step, step.ddp) if step.ddp is not None else None
    if clock is not None:
        spill_ranks(clock.timer)  # finished steps on disk until the frames are gathered
    timed = train_points([clock or step], points, repeats=cfg.steps, warmup_steps=cfg.warmup_steps)
    if clock is None:  # under DDP every rank must take the same steps: the screen only
        timed, _ = retime([step], timed, unresolved, budget_s=DECIDE_BUDGET_S)
    fpt, peak = got.shape.flops_per_token, got.peak
    frame = accum_frame(timed, cfg.tokens_per_step, compile=cfg.compile, flops_per_token=fpt,
                        floor_s=floor_seconds(fpt, cfg.tokens_per_step, peak.flops))
    for i in frame.index[frame["status"] == "ok"]:
        mfu, _, note = judge_mfu(frame.at[i, "tokens_per_s"], fpt, peak.flops, peak.label)
        # the peak is named once, in the mfu frame; a row says only why it has no MFU
        frame.loc[i, ["mfu", "detail"]] = mfu, "" if mfu == mfu else note
    return frame, got, clock
