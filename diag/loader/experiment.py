"""`run_loader(cfg)`: the sweep, the recommendation, the stall split (at the first swept
num_workers) and the hot lines, all against one step made once."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from diag.config import LoaderConfig
from diag.decision import Decision, MeasuredOn
from diag.loader.advice import advice, decide, recommend
from diag.loader.stalls import profile_lines, stall_split
from diag.loader.steps import EmulatedStep, consumer
from diag.loader.sweep import make_dataset, sources, sweep_workers
from diag.machine.device import on_cpu_threads, resolve


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
    """Sweep, recommend, split the stalls, profile the naive preprocessing. step: consumer()'s
    triple (None: cfg's); emulate_stalls: the split sleeps the sweep's median step."""
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
