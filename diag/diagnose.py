"""The whole diagnosis on the embedded defaults (or the user's source): `python -m diag run`.

It measures what this machine is, runs every experiment that exists, times a naive and an
optimized training run with the same StageTimer, and writes the run folder (diag.report). Each
step prints one progress line; the result is the folder's path and the top finding.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from diag import report
from diag.config import DiagnoseConfig, InfoConfig, ToyStepConfig


def training_runs(cfg: DiagnoseConfig) -> pd.DataFrame:
    """The naive and the optimized run, each timed stage by stage, in one frame (`run` column)."""
    from diag.toy import run_toy_step

    frames = []
    for run, workers in (("naive", cfg.naive_workers), ("optimized", cfg.optimized_workers)):
        toy = ToyStepConfig(steps=cfg.steps, prep_ms=cfg.prep_ms, num_workers=workers,
                            device=cfg.device, **({"width": 128} if cfg.steps < 20 else {}))
        frames.append(run_toy_step(toy).assign(run=run))
    return pd.concat(frames, ignore_index=True)


def run_all(cfg: DiagnoseConfig | None = None) -> str:
    """Run the diagnosis and write the report; returns the summary line the CLI prints."""
    from diag.device import run_info

    cfg = cfg or DiagnoseConfig.default()
    steps = [("device facts", lambda: run_info(InfoConfig.default())),
             ("naive vs optimized run", lambda: training_runs(cfg))]
    results = {}
    with tqdm(steps, desc="diag run", unit="experiment") as bar:
        for name, work in bar:
            bar.set_postfix_str(name)
            results[name] = work()
    folder = report.write({"run": results["naive vs optimized run"]}, cfg.out or None,
                          config=cfg.to_dict(), info=results["device facts"])
    summary = report.load_summary(folder)
    top = summary.get("top_finding") or "no finding: nothing measured stands out"
    return f"wrote {Path(folder) / 'report.html'}\ntop finding: {top}"
