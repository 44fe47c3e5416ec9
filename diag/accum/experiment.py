"""`run_accum(cfg)`: a causal LM (the tiny Llama or a GPT-2-small shape, DDP under a launcher)
trained micro_batch x grad_accum at constant tokens per step (`measure`), one summary row per point,
the MFU cross-check and the advice; `decide` takes the fastest point whose gap to the naive
micro-batch resolves, else keeps it."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from diag.accum.sweep import accum_frame, is_oom, pairs, retime, train_points
from diag.config import AccumConfig
from diag.data import BatchLoader, check_tokens, ensure_tokens, token_file
from diag.decision import ADVICE, Decision, MeasuredOn
from diag.embedded import ensure_assets
from diag.machine import device as devices
from diag.machine.device import Peak, on_cpu_threads
from diag.mfu import (ModelShape, count_flops, disagreement, floor_impossible, floor_seconds,
                      judge_mfu, loss_of, over_ranks)
from diag.noise import Choice, choose, clock, compare, spread, unresolved
from diag.timing import stragglers
from diag.timing.distributed import init_group, root_first, spill_ranks
from diag.timing.harness import TimedStep, ranks_first

DEFAULT_MICRO_BATCH = 8  # no sweep ran: fits the tiny and the 1B model on any 16 GB GPU
DECIDE_BUDGET_S = 60.0  # seconds one process may re-time the points its screen left within noise


@dataclass(frozen=True)
class AccumResult:
    """What `run_accum` returns; under a launcher `frame` holds every rank's steps."""

    frame: pd.DataFrame  # one row per timed optimizer step per point (sweep.COLUMNS)
    summary: pd.DataFrame  # one row per point: medians, floor, warm-up, recommended
    mfu: pd.DataFrame  # formula vs FlopCounterMode, and the peak MFU is computed against
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence
    decisions: tuple[Decision, ...] = ()  # micro_batch: the fastest point where it resolves
    ranks: pd.DataFrame | None = None  # under DDP: per point and rank, each stage's median step
    stages: pd.DataFrame | None = None  # under DDP: every rank's timed steps (`run`: the point)


@on_cpu_threads
def run_accum(cfg: AccumConfig | None = None) -> AccumResult:
    """The sweep at cfg's tokens per step, then its summary, MFU cross-check and advice."""
    cfg = cfg or AccumConfig.default()
    frame, mfu, ddp = measure(cfg)
    every, stages = ddp.gathered(frame) if ddp else (ranks_first(frame), None)
    # ranks run in lockstep, so theirs are not independent samples: this rank's steps decide
    frame = every[every["rank"] == (ddp.timer.rank if ddp else 0)]
    ran = mfu.iloc[0]  # the model, precision and device the sweep ran on
    summary = summarize(frame, device=ran["device"])
    on = MeasuredOn(model=f"{cfg.model} ({ran['params'] / 1e6:.3g}M params)",
                    precision=ran["amp"], seq_len=cfg.seq_len,
                    step=f"{cfg.tokens_per_step:,} tokens per optimizer step",
                    device=ran["device"], tokens_per_step=cfg.tokens_per_step)
    return AccumResult(every, summary, mfu, advice(summary, cfg.steps_per_run),
                       decide(frame, on), None if stages is None else stragglers.per_rank(stages),
                       stages)


def decide(frame: pd.DataFrame | None, measured_on: MeasuredOn | None = None,
           baseline: int = 1, repeats_s: float | None = None) -> tuple[Decision, ...]:
    """`micro_batch`: the point `settle` takes on the device's clock; none ran: the default."""
    ok = frame[frame["status"] == "ok"] if frame is not None and not frame.empty else None
    if ok is None or ok.empty:
        why = ("accum frame absent" if frame is None or frame.empty else
               "no accum point ran (" + ", ".join(sorted(set(frame["status"]))) + ")")
        return (Decision.default("micro_batch", DEFAULT_MICRO_BATCH, f"{why}: micro-batch "
                                 f"{DEFAULT_MICRO_BATCH}", source="accum"),)
    on = clock(measured_on.device if measured_on else "")
    column, unit = on.col("seconds_per_step"), on.unit
    times, ref, pick = settle(ok, column, baseline)
    med = {m: statistics.median(t) for m, t in times.items()}
    accum = {int(m): int(a) for m, a in zip(ok["micro_batch"], ok["grad_accum"])}
    micro, gap = pick.value, pick.against
    settled = micro not in (ref, pick.best)  # settle() took a tied point over the fastest
    kept = "the naive plan's" if ref == baseline else "the most accumulation swept"

    def point(m: int) -> str:
        return f"micro-batch {m} x {accum[m]} ({med[m]:.3g} {unit} per step)"

    if gap is None:
        why = (f"{point(micro)}, the only point that ran ({len(times[micro])} samples, spread "
               f"{spread(times[micro]):.0%})")
    elif settled:
        why = (f"{point(micro)} against {point(ref)}: {gap.describe()}; within noise of the "
               f"fastest, {point(pick.best)}: the least accumulation of them (the Trainer pays "
               "per micro-batch what this step does not time)")
    elif pick.best != ref:
        why = (f"{point(pick.best)}, the fastest of {len(times)} points, against "
               f"{point(ref)}: {gap.describe()}"
               + ("" if micro != ref else f"; micro-batch {ref} kept ({kept})"))
    else:
        why = (f"{point(ref)} ({kept}) is the fastest of {len(times)} points, against "
               f"{point(pick.rival)}: {gap.describe()}")
    tied = tuple(m for m in (pick.best, *pick.tied) if m != micro) if settled else pick.tied
    if tied and micro != ref:
        why += "; within noise of the fastest: " + ", ".join(f"micro-batch {m}" for m in tied)
    if repeats_s:
        why += f"; {repeats_s:.2g} s re-timing the finalists"
    why += f"; compared on {on}"
    sides = [micro] if gap is None else [micro, ref if micro != ref else pick.best]
    return (Decision.from_rows(
        "micro_batch", micro, why, ok[ok["micro_batch"].isin({micro, ref, pick.best})],
        source="accum", measured_on=measured_on, baseline=baseline, stage="compute",
        per="step", clock=on.name, baseline_s=med.get(baseline), chosen_s=med[micro],
        naive_ratio=med[baseline] / med[micro] if baseline in med else None,
        samples=tuple(len(times[m]) for m in sides), spread=tuple(spread(times[m]) for m in sides),
        tied=tied, resolved=pick.resolved, repeats_s=repeats_s),)


def settle(ok: pd.DataFrame, column: str, baseline: int
           ) -> tuple[dict[int, list[float]], int, Choice]:
    """(samples by micro-batch, the reference, diag.noise.choose's pick against it)."""
    times = {int(m): list(g[column]) for m, g in ok.groupby("micro_batch")}
    ref = baseline if baseline in times else min(times)
    pick = choose(times, ref)
    if pick.value == ref or not pick.tied:
        return times, ref, pick
    wins = {m: compare(times[m], times[ref]) for m in (pick.value, *pick.tied) if m != ref}
    largest = max(m for m, gap in wins.items() if gap.faster == "a")
    return times, ref, dataclasses.replace(pick, value=largest, against=wins[largest])


def summarize(frame: pd.DataFrame, baseline: int = 1, device: str = "") -> pd.DataFrame:
    """Per point: medians, floor, memory; `recommended` on the point `decide` takes."""
    keys = ["micro_batch", "grad_accum", "tokens_per_step", "status"]
    first = {"floor_s": "first", "peak_mem_gb": "max", "warmup_s": "first", "compile": "first",
             "detail": "first"}
    medians = {c: "median" for c in ("seconds_per_step", "cpu_s", "tokens_per_s", "data_s",
                                     "comm_wait_s", "compute_s", "mfu") if c in frame.columns}
    out = frame.groupby(keys, sort=False, dropna=False).agg(
        {**medians, **first, "repeat": "count"}).reset_index().rename(columns={"repeat": "steps"})
    out.loc[out["status"] != "ok", "steps"] = 0
    ok = out[out["status"] == "ok"]
    out["vs_worst"] = out["tokens_per_s"] / ok["tokens_per_s"].min() if not ok.empty else math.nan
    out["recommended"] = False
    if not ok.empty:
        pick = settle(frame[frame["status"] == "ok"], clock(device).col("seconds_per_step"),
                      baseline)[2]
        out.loc[ok.index[ok["micro_batch"] == pick.value][0], "recommended"] = True
    out["floor_flagged"] = [floor_impossible(f, s) for f, s in
                            zip(out["floor_s"], out["seconds_per_step"])]
    cols = ["micro_batch", "grad_accum", "tokens_per_step", "status", "seconds_per_step",
            "cpu_s", "floor_s", "floor_flagged", "tokens_per_s", "vs_worst", "mfu", "peak_mem_gb",
            "data_s", "comm_wait_s", "compute_s", "warmup_s", "compile", "steps", "recommended",
            "detail"]
    return pd.DataFrame(out[[c for c in cols if c in out.columns]])


def mfu_check(shape: ModelShape, peak: Peak, counted: float, amp: str, device: str
              ) -> pd.DataFrame:
    """The formula's FLOPs per token beside FlopCounterMode's (`counted`), and the MFU peak."""
    formula = shape.flops_per_token
    common = {"params": shape.params, "layers": shape.layers, "d_model": shape.d_model,
              "seq_len": shape.seq_len, "amp": amp, "device": device,
              "peak_tflops": peak.flops / 1e12 if peak.flops else math.nan,
              "peak": peak.label + (f" ({peak.source})" if peak.source and not peak.measured
                                    else "")}
    flagged, note = disagreement(formula, counted,
                                 "check N (tied or untied head), the attention term, and kernels "
                                 "the counter has no formula for")
    return pd.DataFrame([
        {"method": "formula 6N + 12·L·d·T", "flops_per_token": formula, "vs_formula": 1.0,
         "flagged": False, "note": "", **common},
        {"method": "FlopCounterMode, one micro-step", "flops_per_token": counted,
         "vs_formula": counted / formula, "flagged": flagged, "note": note, **common},
    ])


def advice(summary: pd.DataFrame, steps_per_run: int, compute_s: float | None = None
           ) -> pd.DataFrame:
    """The recommended point against the most-accumulating one, per steps_per_run or compute_s."""
    ok = summary[summary["status"] == "ok"]
    picked = ok[ok["recommended"].astype(bool)]
    worst = ok.loc[ok["grad_accum"].idxmax()] if len(ok) else None
    if len(ok) < 2 or picked.empty or picked.index[0] == worst.name:
        return pd.DataFrame(columns=ADVICE)
    best = picked.iloc[0]
    largest = ok.loc[ok["micro_batch"].idxmax()]
    fraction = 1.0 - best["seconds_per_step"] / worst["seconds_per_step"]
    saved, over = ((worst["seconds_per_step"] - best["seconds_per_step"]) * steps_per_run,
                   f"over {steps_per_run:,} steps") if compute_s is None else (compute_s * fraction,
        f"{fraction:.0%} shorter steps applied to the run's compute ({compute_s:.3g} s)")
    ooms = summary[summary["status"] == "oom"]
    edge = (f"; micro-batch {int(ooms['micro_batch'].min())} ran out of memory"
            if not ooms.empty else "")
    note = ("" if best["micro_batch"] == largest["micro_batch"] else
            f"; the largest that fits ({int(largest['micro_batch'])}) was slower here")
    mfu = f", MFU {best['mfu']:.1%}" if best["mfu"] == best["mfu"] else ""
    evidence = (f"{int(best['micro_batch'])} x {int(best['grad_accum'])}: "
                f"{best['tokens_per_s']:,.0f} tokens/s, {best['seconds_per_step']:.3g} s/step{mfu}"
                f" vs {int(worst['micro_batch'])} x {int(worst['grad_accum'])}: "
                f"{worst['tokens_per_s']:,.0f} tokens/s "
                f"({best['tokens_per_s'] / worst['tokens_per_s']:.2f}x)"
                f" at {int(best['tokens_per_step']):,} tokens per step, medians, {over}{edge}"
                f"{note}; floor {best['floor_s']:.3g} s/step at 100% MFU")
    finding = (f"train with micro-batch {int(best['micro_batch'])} x grad_accum "
               f"{int(best['grad_accum'])}: the same tokens per step, fewer accumulation steps")
    return pd.DataFrame([("compute", finding, max(0.0, saved), evidence)], columns=ADVICE)


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

    @contextlib.contextmanager
    def batches(self, micro_batch: int) -> Iterator[Any]:
        with BatchLoader(self._tokens, micro_batch, self._cfg.seq_len, self.device,
                         seed=self._seed) as loader:  # slow_rank's: slow_ms more per batch
            yield (time.sleep(self._slow_s) or b for b in loader) if self._slow_s else loader

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


def build_model(cfg: AccumConfig, device: torch.device) -> Any:
    """The embedded tiny Llama, or a GPT-2-small shape (nanoGPT's padded vocab), random init."""
    if cfg.model == "tiny":
        from transformers import LlamaForCausalLM

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


def measure(cfg: AccumConfig) -> tuple[pd.DataFrame, pd.DataFrame, TimedStep | None]:
    """The sweep frame (COLUMNS), its mfu_check, and under a launcher this rank's TimedStep."""
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
    ddp = TimedStep(step, step.ddp) if step.ddp is not None else None
    if ddp is not None:
        spill_ranks(ddp.timer)  # finished steps on disk until the frames are gathered
    timed = train_points([ddp or step], points, repeats=cfg.steps, warmup_steps=cfg.warmup_steps)
    if ddp is None:  # under DDP every rank must take the same steps: the screen only
        timed, _ = retime([step], timed, unresolved, budget_s=DECIDE_BUDGET_S)
    fpt = shape.flops_per_token
    frame = accum_frame(timed, cfg.tokens_per_step, compile=cfg.compile, flops_per_token=fpt,
                        floor_s=floor_seconds(fpt, cfg.tokens_per_step, peak.flops))
    for i in frame.index[frame["status"] == "ok"]:
        mfu, _, note = judge_mfu(frame.at[i, "tokens_per_s"], fpt, peak.flops, peak.label)
        # the peak is named once, in the mfu frame; a row says only why it has no MFU
        frame.loc[i, ["mfu", "detail"]] = mfu, "" if mfu == mfu else note
    return frame, mfu_check(shape, peak, counted, amp_dtype, str(dev)), ddp
