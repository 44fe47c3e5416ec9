"""The grad-accumulation harness: a step's tokens split micro_batch x grad_accum, trained for real;
`retime` re-times in interleaved rounds the finalists a decision cannot tell apart yet."""
from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import pandas as pd
import torch
from tqdm.auto import tqdm

from diag.config import AccumConfig
from diag.config.accum import check_divides
from diag.machine.device import sync
from diag.noise import MIN_SAMPLES, clock, interleave

COLUMNS = ["micro_batch", "grad_accum", "tokens_per_step", "seconds_per_step", "cpu_s", "floor_s",
           "tokens_per_s", "data_s", "compute_s", "peak_mem_gb", "flops_per_token", "mfu",
           "status", "repeat", "warmup_s", "compile", "detail"]
# train_points' rows: `step` indexes the AccumStep; peak_mem_gb its own peak (PeakMemory)
TIMED = ["step", "micro_batch", "grad_accum", "status", "repeat", "seconds_per_step", "cpu_s",
         "data_s", "peak_mem_gb", "warmup_s", "detail"]


class AccumStep(Protocol):
    """What train_points drives: one model, trained a micro-batch at a time."""

    device: torch.device
    model: torch.nn.Module  # its parameters, buffers and gradients count in a step's memory
    optimizer: torch.optim.Optimizer | None  # and its state

    def batches(self, micro_batch: int) -> AbstractContextManager[Iterator[Any]]: ...  # a point's
    def reset(self) -> None: ...  # the starting weights, no gradients, a fresh optimizer
    def backward(self, batch: Any, scale: float) -> None: ...  # loss x scale; gradients add up
    def no_sync(self) -> AbstractContextManager[Any]: ...  # DDP's, around all but the last
    def update(self) -> None: ...  # the optimizer step, then zero_grad


def pairs(cfg: AccumConfig, world_size: int = 1) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) points: the micro-batches given, else powers of two that fit."""
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
    text = str(err).lower()
    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or isinstance(
        err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class PeakMemory:
    """A step's own peak: CUDA's high water mark; on CPU saved tensors + state (calibration.md)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.last_gb = device, math.nan
        self.most_saved = 0  # bytes saved for backward by one micro-step of the watched step, most
        self._params: set[int] = set()  # the model state's storages

    @contextlib.contextmanager
    def watch(self, step: AccumStep) -> Iterator[None]:
        """Around one optimizer step: `last_gb` holds its peak (NaN if it raised)."""
        self.last_gb = math.nan
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.last_gb = torch.cuda.max_memory_allocated(self.device) / 1e9
            return
        state = [*step.model.parameters(), *step.model.buffers()]
        self._params = {t.untyped_storage().data_ptr() for t in state}
        self.most_saved = 0
        yield
        grads = sum(p.numel() * p.element_size() for p in step.model.parameters()
                    if p.requires_grad)
        held = _unique_bytes(state) + grads + _unique_bytes(
            t for s in (step.optimizer.state.values() if step.optimizer else ())
            for t in s.values() if isinstance(t, torch.Tensor))
        self.last_gb = (held + self.most_saved) / 1e9

    def gb(self) -> float:
        """The watched step's peak; on CUDA a failed step's too."""
        cuda = self.device.type == "cuda"
        return torch.cuda.max_memory_allocated(self.device) / 1e9 if cuda else self.last_gb

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[None]:
        """Around one forward + backward: what autograd saves for it (CPU)."""
        if self.device.type == "cuda":
            yield
            return
        saved: dict[int, int] = {}  # bytes by storage

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.most_saved = max(self.most_saved, sum(  # a weight is a parameter's bytes
            n for ptr, n in saved.items() if ptr not in self._params))


def _unique_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under tensors."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def train_points(steps: Sequence[AccumStep], points: Sequence[tuple[int, int]], *,
                 repeats: int, warmup_steps: int, desc: str = "accum sweep") -> pd.DataFrame:
    """TIMED rows: one per timed optimizer step of each step at each point; "oom" where it fails."""
    device, rows = steps[0].device, []
    memory = PeakMemory(device)
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
        if rows and rows[-1]["status"] == "oom":  # its error's frames hold activations in a cycle
            gc.collect()  # before the next point allocates; only then: a pass costs ~0.5 s
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows, columns=TIMED)


def _train_point(steps: Sequence[AccumStep], micro: int, accum: int, repeats: int,
                 warmup_steps: int, memory: PeakMemory) -> list[dict[str, Any]]:
    """One point's timed rows; memory watched over the last warm-up step (none: the first)."""
    watched = max(warmup_steps - 1, 0)

    def measure(i: int, n: int) -> tuple[float, ...]:
        with memory.watch(steps[i]) if n == watched else contextlib.nullcontext():
            timed = _timed(steps[i], batches[i], accum, memory if n == watched else None)
        return (*timed, memory.last_gb)

    with contextlib.ExitStack() as stack:
        for step in steps:
            step.reset()  # every point starts from the same weights
        batches = [stack.enter_context(step.batches(micro)) for step in steps]
        rounds = warmup_steps + repeats  # warm-up (and compile) billed to warm-up
        got, _ = interleave(range(len(steps)), measure, min_rounds=rounds, max_rounds=rounds)
    return [row for i, side in got.items() for row in _rows(
        (i, micro, accum), 0, side[warmup_steps:], side[watched][3],
        sum(t[0] for t in side[:warmup_steps]))]


def _rows(key: tuple[int, int, int], first: int, timings: Sequence[tuple[float, ...]],
          peak_gb: float, warmup_s: float) -> list[dict[str, Any]]:
    """TIMED rows of one step at one point from _timed's triples, repeats from `first`."""
    return [{"step": key[0], "micro_batch": key[1], "grad_accum": key[2], "status": "ok",
             "repeat": first + n, "seconds_per_step": t[0], "cpu_s": t[1], "data_s": t[2],
             "peak_mem_gb": peak_gb, "warmup_s": warmup_s, "detail": ""}
            for n, t in enumerate(timings)]


def retime(steps: Sequence[AccumStep], timed: pd.DataFrame,
           pending: Callable[[dict[tuple[int, int, int], list[float]]], Sequence[Any]], *,
           budget_s: float, at_least: int | None = None) -> tuple[pd.DataFrame, float]:
    """(timed + rounds while `pending` names a finalist, seconds past at_least) within budget_s."""
    at_least = max(MIN_SAMPLES, at_least or 0)  # fewer can never resolve a gap
    column = clock(steps[0].device.type).col("seconds_per_step")
    ok = timed[timed["status"] == "ok"]
    screen = {(int(i), int(m), int(a)): list(g[column])  # each step and point's, in timed order
              for (i, m, a), g in ok.groupby(["step", "micro_batch", "grad_accum"], sort=False)}
    keys = [k for k in dict.fromkeys(pending(screen)) if k in screen]
    fewest = min((len(v) for v in screen.values()), default=0)
    if not keys and fewest >= at_least:
        return timed, 0.0
    keys = keys if fewest >= at_least else list(screen)  # too few: every side gets its share
    compared = 1 if column == "cpu_s" else 0  # of _timed's (seconds, cpu_s, data_s)

    def measure(key: tuple[int, int, int], _: int) -> tuple[float, float, float]:
        steps[key[0]].reset()
        return _timed(steps[key[0]], iters[key], key[2])

    def unsettled(got: dict[Any, list[tuple[float, float, float]]]) -> bool:
        merged = {k: screen[k] + [t[compared] for t in got.get(k, [])] for k in screen}
        return any(k in keys for k in pending(merged))

    with contextlib.ExitStack() as stack:
        iters = {k: stack.enter_context(steps[k[0]].batches(k[1])) for k in keys}
        timings, rounds = interleave(keys, measure, unsettled, budget_s=budget_s,
                                     min_rounds=max(1, at_least - fewest),
                                     owed=max(0, at_least - fewest))
    first = ok.groupby(["step", "micro_batch"]).first()
    rows = [row for k, side in timings.items() for row in _rows(
        k, len(screen[k]), side, *first.loc[k[:2], ["peak_mem_gb", "warmup_s"]])]
    return pd.concat([timed, pd.DataFrame(rows, columns=TIMED)], ignore_index=True), rounds.spent_s


def _timed(step: AccumStep, batches: Iterator[Any], accum: int,
           memory: PeakMemory | None = None) -> tuple[float, float, float]:
    """One optimizer step of `accum` micro-steps: (wall s, CPU s, seconds waiting on batches)."""
    sync(step.device)  # note: sync point: the clock starts on an idle device
    start, cpu, data_s = time.perf_counter(), time.process_time(), 0.0
    for i in range(accum):
        t = time.perf_counter()
        batch = next(batches)
        data_s += time.perf_counter() - t
        # DDP: only the last micro-step all-reduces; the others accumulate locally
        with step.no_sync() if i < accum - 1 else contextlib.nullcontext(), \
                memory.micro_step() if memory else contextlib.nullcontext():
            step.backward(batch, 1.0 / accum)  # the mean over the whole step's tokens
    step.update()
    sync(step.device)  # note: sync point: the step's kernels finish inside its time
    return time.perf_counter() - start, time.process_time() - cpu, data_s


def accum_frame(timed: pd.DataFrame, tokens_per_step: int, *, floor_s: float = math.nan,
                flops_per_token: float = math.nan, compile: bool = False, detail: str = ""
                ) -> pd.DataFrame:
    """train_points rows as the sweep's COLUMNS; mfu left to the caller that knows the peak."""
    seconds = timed["seconds_per_step"]
    out = timed.assign(tokens_per_step=tokens_per_step, tokens_per_s=tokens_per_step / seconds,
                       compute_s=seconds - timed["data_s"], floor_s=floor_s,
                       flops_per_token=flops_per_token, mfu=math.nan, compile=compile,
                       detail=timed["detail"].where(timed["status"] != "ok", detail))
    return pd.DataFrame(out[COLUMNS]).astype({"compile": bool})
