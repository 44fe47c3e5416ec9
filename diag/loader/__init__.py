"""The data loader: does it keep up with the step, why not, and the smallest setting that does.
`run_loader(cfg)`: the sweep, the decisions, the stall split and the hot lines, all against one
step made once. `stall_split`: DS-Analyzer's differential method (Mohan et al., 2021) on synthetic,
warm and cold data: prep stall = warm - synthetic, fetch stall = cold - warm. `profile_lines`: the
preprocessing's hot lines (line_profiler; read shares, not times)."""
from __future__ import annotations

import inspect
import linecache
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd
from line_profiler import LineProfiler

from diag.config import LoaderConfig
from diag.data import ARRAYS, shard_files
from diag.decision import Decision, MeasuredOn
from diag.loader.advice import advice, choose_workers, decide, recommend
from diag.loader.sweep import Setting, make_dataset, measure_setting, sources, sweep_workers
from diag.loader.toy import EmulatedStep, consumer
from diag.machine.device import on_cpu_threads, resolve
from diag.machine.disks import evict_page_cache

__all__ = ["LoaderResult", "choose_workers", "decide", "recommend", "run_loader", "sweep_workers"]


@dataclass(frozen=True)
class LoaderResult:
    """What `run_loader` returns; the CLI shows each frame, diagnose stores them as loader_*."""

    sweep: pd.DataFrame  # one row per pipeline x num_workers x repeat (diag.loader.sweep.COLUMNS)
    stalls: pd.DataFrame  # per pipeline: synthetic / warm / cold waits, prep and fetch stalls
    lines: pd.DataFrame  # line profile of NaiveTextDataset.__getitem__: where a sample's time goes
    recommendation: pd.DataFrame  # per pipeline: the smallest setting that keeps up, or the cost
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence (for amdahl.findings)
    decisions: tuple[Decision, ...] = ()  # pipeline, num_workers and the knobs (advice.decide)


@on_cpu_threads
def run_loader(cfg: LoaderConfig | None = None, step: tuple | None = None,
               measured_on: MeasuredOn | None = None, emulate_stalls: bool = False
               ) -> LoaderResult:
    """Sweep, recommend, split the stalls, profile the naive preprocessing (step: consumer()'s)."""
    cfg = cfg or LoaderConfig.default()
    data, tokenizer_dir = sources(cfg)
    step = step or consumer(cfg, tokenizer_dir, resolve(cfg.device))
    sweep = sweep_workers(cfg, step)
    recommendation = recommend(sweep, cfg.target_share)
    stalls = stall_split(cfg, cfg.workers[0], EmulatedStep(float(sweep["step_s"].median()))
                         if emulate_stalls else step[0])
    naive = make_dataset("naive", cfg, data, tokenizer_dir)[0].base  # its records' parse cached
    lines = profile_lines(naive.__getitem__, range(min(cfg.profile_samples, len(naive))))
    on = measured_on or MeasuredOn(seq_len=cfg.seq_len, step=step[2],
                                   device=str(resolve(cfg.device)))
    return LoaderResult(sweep, stalls, lines, recommendation,
                        advice(sweep, recommendation, cfg.run_steps, cfg.target_share),
                        decide(sweep, cfg.target_share, on))

COLUMNS = ["pipeline", "num_workers", "synthetic_wait_s", "warm_wait_s", "cold_wait_s",
           "prep_stall_s", "fetch_stall_s", "step_s", "prep_stall_share", "fetch_stall_share",
           "open_warm_s", "open_cold_s", "cache_state", "error"]
LINE_COLUMNS = ["line", "hits", "seconds", "share", "us_per_hit", "source", "function"]


def stall_split(cfg: LoaderConfig | None = None, num_workers: int | None = None,
                step: Any = None) -> pd.DataFrame:
    """Synthetic / warm / cold runs per pipeline at num_workers (default: cfg.workers[0])."""
    cfg = cfg or LoaderConfig.default()
    data, tokenizer_dir = sources(cfg)
    device = resolve(cfg.device)
    step = consumer(cfg, tokenizer_dir, device)[0] if step is None else step
    w = cfg.workers[0] if num_workers is None else num_workers
    nominal = None
    if w == 0 and isinstance(step, EmulatedStep):
        # no workers: the step's length cannot change the wait; accounted, not slept
        nominal, step = step.seconds, EmulatedStep(0.0)
    setting = Setting(w, cfg.pin_memory, cfg.persistent_workers, cfg.prefetch_factor)
    rows = []
    for pipeline in cfg.pipelines:
        row, steps_s, errors = {"pipeline": pipeline, "num_workers": w}, [], []
        made = make_dataset(pipeline, cfg, data, tokenizer_dir)[0].base  # reads the records
        arrays = [made.folder / f for f in ARRAYS] if pipeline == "packed" else []  # token cache
        records, made = shard_files(data), None  # a live memory map would pin its pages
        for state in ("warm", "cold", "synthetic"):
            if state == "warm":  # the token cache's arrays into the page cache too
                for path in arrays:
                    with open(path, "rb") as f:
                        while f.read(1 << 20):
                            pass
            elif state == "cold":  # a live memory map pins its pages: drop the warm run's first
                dataset = None
                row["cache_state"] = evict_page_cache(records + arrays)  # "cold", or why not
            start = time.perf_counter()
            if state != "synthetic":
                dataset, _ = make_dataset(pipeline, cfg, data, tokenizer_dir)
                row[f"open_{state}_s"] = time.perf_counter() - start
            else:  # the same sample every time: the loop with no data path at all
                dataset = [dataset[0]] * len(dataset)
            got = measure_setting(dataset, setting, step, pipeline=pipeline, device=device,
                                  batch_size=cfg.batch_size, steps=cfg.steps,
                                  timeout_s=cfg.timeout_s, consumer=cfg.consumer)[0]
            row[f"{state}_wait_s"] = got["data_wait_s"]
            steps_s.append(got["step_s"])
            errors += [f"{state}: {got['error']}"] if got["error"] else []
        rows.append({**row, "error": "; ".join(errors), "step_s": float(
            pd.Series(steps_s).median()) if nominal is None else nominal})
    out = pd.DataFrame(rows, columns=COLUMNS)
    out["prep_stall_s"] = (out["warm_wait_s"] - out["synthetic_wait_s"]).clip(lower=0.0)
    out["fetch_stall_s"] = (out["cold_wait_s"] - out["warm_wait_s"]).clip(lower=0.0)
    for stall in ("prep", "fetch"):
        out[f"{stall}_stall_share"] = out[f"{stall}_stall_s"] / (out["step_s"] + out["cold_wait_s"])
    return out


def profile_lines(fn: Callable[[Any], Any], samples: Iterable[Any], warmup: bool = True
                  ) -> pd.DataFrame:
    """fn over samples under line_profiler, in source order; warmup: one unprofiled call first."""
    target = getattr(fn, "__func__", fn)  # a bound method: profile the function it wraps
    if not inspect.isfunction(target):
        raise ValueError(f"fn={fn!r}: profile_lines needs a Python function or method "
                         "(builtins and C extensions have no lines to profile)")
    samples = list(samples)
    if not samples:
        raise ValueError("samples is empty: give at least one sample to call fn with")
    if warmup:
        fn(samples[0])
    profiler = LineProfiler(target)
    with profiler:  # enabled by count inside, disabled on the way out
        for sample in samples:
            fn(sample)
    stats = profiler.get_stats()
    rows = [{"line": line, "hits": hits, "seconds": total * stats.unit,
             "us_per_hit": total * stats.unit / hits * 1e6 if hits else float("nan"),
             "source": linecache.getline(filename, line).strip(), "function": name}
            for (filename, _, name), timings in stats.timings.items()
            for line, hits, total in timings]
    frame = pd.DataFrame(rows, columns=LINE_COLUMNS).sort_values("line", ignore_index=True)
    total = frame["seconds"].sum()
    frame["share"] = frame["seconds"] / total if total > 0 else 0.0
    return frame
