"""The grad-accumulation harness: the same tokens per optimizer step, split micro_batch x
grad_accum, timed on any `AccumStep` (diag accum's model, diag.accum.model; the QLoRA job's step).

`train_points(steps, points)` trains each point for real: each step reset to its starting weights,
`warmup_steps` untimed steps (allocator, kernels, compile: `warmup_s`), then `repeats` timed ones,
one row each, several steps alternating step by step so a load change hits them alike. A point
that runs out of memory is a row with status "oom" and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from diag.config import AccumConfig

COLUMNS = ["micro_batch", "grad_accum", "tokens_per_step", "seconds_per_step", "floor_s",
           "tokens_per_s", "data_s", "compute_s", "peak_mem_gb", "flops_per_token", "mfu",
           "status", "repeat", "warmup_s", "compile", "detail"]
# train_points' rows: `step` is the step's index; peak_mem_gb the process's peak during the
# timed step, growth_gb what the step itself added at its peak
TIMED = ["step", "micro_batch", "grad_accum", "status", "repeat", "seconds_per_step", "data_s",
         "peak_mem_gb", "growth_gb", "warmup_s", "detail"]


class AccumStep(Protocol):
    """What train_points drives: one model, trained a micro-batch at a time."""

    device: torch.device

    def batches(self, micro_batch: int) -> AbstractContextManager[Iterator[Any]]: ...  # a point's
    def reset(self) -> None: ...  # the starting weights, no gradients, a fresh optimizer
    def backward(self, batch: Any, scale: float) -> None: ...  # loss x scale; gradients add up
    def no_sync(self) -> AbstractContextManager[Any]: ...  # DDP's, around all but the last
    def update(self) -> None: ...  # the optimizer step, then zero_grad


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


def train_points(steps: Sequence[AccumStep], points: Sequence[tuple[int, int]], *,
                 repeats: int, warmup_steps: int, desc: str = "accum sweep") -> pd.DataFrame:
    """One row per timed optimizer step of each step at each (micro_batch, grad_accum) point
    (TIMED); a point that runs out of memory: one "oom" row per step, its `detail` the error."""
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    device = steps[0].device
    memory = PeakMemory(device)
    rows: list[dict[str, Any]] = []
    for micro, accum in tqdm(points, desc=desc, unit="point", leave=False):
        try:
            rows += _train_point(steps, micro, accum, repeats, warmup_steps, memory)
        except (RuntimeError, MemoryError) as err:
            if not is_oom(err):
                raise
            rows += [{"step": i, "micro_batch": micro, "grad_accum": accum, "status": "oom",
                      "repeat": 0, "peak_mem_gb": memory.gb(),
                      "detail": f"out of memory: {' '.join(str(err).split())[:160]}"}
                     for i in range(len(steps))]
        finally:
            gc.collect()  # the failed point's activations go before the next point allocates
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return pd.DataFrame(rows, columns=TIMED)


def _train_point(steps: Sequence[AccumStep], micro: int, accum: int, repeats: int,
                 warmup_steps: int, memory: PeakMemory) -> list[dict[str, Any]]:
    """The timed rows of one point: each step reset and warmed up, then timed in turn."""
    from diag.machine.device import sync

    device = steps[0].device
    with contextlib.ExitStack() as stack:
        batches = []
        for step in steps:
            step.reset()  # every point starts from the same weights
            batches.append(stack.enter_context(step.batches(micro)))
        memory.reset()
        warm = [0.0] * len(steps)
        for _ in range(warmup_steps):
            for i, step in enumerate(steps):
                sync(device)  # note: sync point: the clock starts on an idle device
                start = time.perf_counter()
                _optimizer_step(step, batches[i], accum)
                sync(device)  # note: sync point: warm-up (and compile) kernels billed to warm-up
                warm[i] += time.perf_counter() - start
        rows = []
        for repeat in range(repeats):
            for i, step in enumerate(steps):
                memory.reset()
                start = time.perf_counter()
                data_s = _optimizer_step(step, batches[i], accum)
                sync(device)  # note: sync point: the step's queued kernels finish inside its time
                rows.append({"step": i, "micro_batch": micro, "grad_accum": accum,
                             "status": "ok", "repeat": repeat,
                             "seconds_per_step": time.perf_counter() - start, "data_s": data_s,
                             "peak_mem_gb": memory.gb(), "growth_gb": memory.growth_gb(),
                             "warmup_s": warm[i]})
    return rows


def _optimizer_step(step: AccumStep, batches: Iterator[Any], accum: int) -> float:
    """One optimizer step of `accum` micro-steps; returns the seconds blocked on batches.

    No sync inside: on CUDA the host queues micro-step after micro-step while the device runs,
    and a prefetched batch's copy is queued behind them (`data_s` is host time spent waiting).
    """
    data_s = 0.0
    for i in range(accum):
        t = time.perf_counter()
        batch = next(batches)
        data_s += time.perf_counter() - t
        # DDP: only the last micro-step all-reduces; the others accumulate locally
        with step.no_sync() if i < accum - 1 else contextlib.nullcontext():
            step.backward(batch, 1.0 / accum)  # the mean over the whole step's tokens
    step.update()
    return data_s


def accum_frame(timed: pd.DataFrame, tokens_per_step: int, *, floor_s: float = math.nan,
                flops_per_token: float = math.nan, compile: bool = False, detail: str = ""
                ) -> pd.DataFrame:
    """One step's train_points rows as the sweep's (COLUMNS): tokens/s at tokens_per_step, the
    step less its data wait as compute_s, and what the rows were measured with (an "oom" row
    keeps its error as `detail`); mfu is left to the caller that knows the peak."""
    import pandas as pd

    seconds = timed["seconds_per_step"]
    out = timed.assign(tokens_per_step=tokens_per_step, tokens_per_s=tokens_per_step / seconds,
                       compute_s=seconds - timed["data_s"], floor_s=floor_s,
                       flops_per_token=flops_per_token, mfu=math.nan, compile=compile,
                       detail=timed["detail"].where(timed["status"] != "ok", detail))
    return pd.DataFrame(out[COLUMNS]).astype({"compile": bool})
