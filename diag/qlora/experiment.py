"""Naive vs optimized QLoRA run on the same records, seed and schedule: where the time went.

`run_qlora(cfg)` runs the plans (cfg.plan) against the same sources and returns one row per plan
(end-to-end seconds, padding share, final loss), the stage rows, the loss curves, the shares
(diag.amdahl), each plan's settings with their evidence, and fix by fix the predicted vs the
measured saving (a prediction off by more than 25% is flagged, not hidden).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.decision import PREDICTION_TOLERANCE  # noqa: F401  # re-exported for callers
from diag.qlora.plans import Plan
from diag.qlora.predict import FIXES, savings  # noqa: F401

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import QLoraConfig

# Result frames the optimized plan reads from a run folder, by the CSV names report.write gives.
RESULT_FILES = {"storage": ("storage",), "model_load": ("model_load",),
                "loader": ("loader", "workers"), "accum": ("accum",)}


@dataclass(frozen=True)
class QLoraResult:
    """What `run_qlora` returns (first field: the main table)."""

    frame: pd.DataFrame  # one row per plan: seconds end to end, tokens, padding, final loss
    stages: pd.DataFrame  # StageTimer rows of every plan (`run` = plan name)
    losses: pd.DataFrame  # run, step, loss, learning_rate
    shares: pd.DataFrame  # diag.amdahl.shares of the stages, per plan
    plans: pd.DataFrame  # run, setting, value, evidence
    savings: pd.DataFrame  # stage, predicted_s, measured_s, error_share, flagged, evidence
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence


def load_results(folder: str | Path) -> dict[str, Any]:
    """The experiment frames a run folder holds (CSV per frame), keyed as Plan.optimized reads."""
    import pandas as pd

    if not folder:
        return {}
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"QLoraConfig.results={str(folder)!r}: no such run folder")
    found = {}
    for key, names in RESULT_FILES.items():
        for name in names:
            if (folder / f"{name}.csv").is_file():
                found[key] = pd.read_csv(folder / f"{name}.csv")
                break
    return found


def run_qlora(cfg: QLoraConfig | None = None, results: dict[str, Any] | None = None
              ) -> QLoraResult:
    """Run cfg.plan ("naive", "optimized" or "both"); `results` (frames by experiment) or
    cfg.results (a run folder) feed Plan.optimized."""
    import pandas as pd
    from tqdm.auto import tqdm

    from diag.amdahl import shares
    from diag.config import QLoraConfig
    from diag.device import resolve
    from diag.qlora.job import open_sources, prime, run_plan

    cfg = cfg or QLoraConfig.default()
    results = results if results is not None else load_results(cfg.results)
    device = str(resolve(cfg.device))
    plans = []
    if cfg.plan in ("naive", "both"):
        plans.append(Plan.naive())
    if cfg.plan in ("optimized", "both"):
        plans.append(Plan.optimized(results, device=device))
    runs = []
    with open_sources(cfg) as src:
        for plan in tqdm(plans, desc="qlora plans", leave=False):
            # an optimized start finds the landed data, cached model and tokens: the first
            # start pays them once, untimed here and reported as once_s
            once = prime(cfg, plan, src) if plan.name == "optimized" else 0.0
            runs.append(run_plan(cfg, plan, src) | {"once_s": once})
    frame = pd.DataFrame([r["summary"] | {"once_s": r["once_s"]} for r in runs])
    stages = pd.concat([r["stages"] for r in runs], ignore_index=True)
    losses = pd.concat([r["losses"] for r in runs], ignore_index=True)
    table = shares(stages)
    plan_rows = pd.DataFrame([{"run": p.name, "setting": k, "value": str(v),
                               "evidence": dict(p.evidence).get(k, "")}
                              for p in plans for k, v in p.settings().items() if k != "name"])
    saved = savings(table, results, frame)
    advice = saved.rename(columns={"measured_s": "seconds_saved"})[
        ["stage", "finding", "seconds_saved", "evidence"]]
    return QLoraResult(frame, stages, losses, table, plan_rows, saved, advice)
