"""What attach and trace say: amdahl's verdict, fixes, the upgrade, how sure a sampled share is."""

from __future__ import annotations

import math

import pandas as pd

from diag import amdahl

WIDE = 0.05  # a sampled share whose 95% interval reaches further than this either side says so


def interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval of a share k/n (it treats the samples as independent: a stage
    that comes in long runs of samples is less sure than this)."""
    if n <= 0:
        return float("nan"), float("nan")
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return max(centre - half, 0.0), min(centre + half, 1.0)


def story(stages: pd.DataFrame, current_gpu: str, target_gpu: str, note: str = ""
          ) -> tuple[pd.DataFrame, pd.DataFrame | None, pd.DataFrame | None]:
    """(verdict: one row; fixes: amdahl.findings; projection: amdahl.upgrade), None for none."""
    said = amdahl.verdict(amdahl.shares(stages))
    fixes = amdahl.findings(stages)
    projection, upgrade = pd.DataFrame(), "no upgrade projection: " + (
        "name --current-gpu" if not current_gpu else f"{current_gpu} is not in diag's table")
    if current_gpu:
        try:
            projection = amdahl.upgrade(stages, current_gpu, target_gpu)
        except ValueError:
            projection = pd.DataFrame()
    if not projection.empty:
        total = projection[projection["stage"] == "total"].iloc[0]
        saved = 1 - total["seconds_after"] / total["seconds_before"]
        upgrade = (f"{target_gpu} instead of {current_gpu}: {total['speedup']:.3g}x, "
                   f"{saved:.0%} of the wall clock saved (only compute and warm-up shrink)")
    top = fixes.iloc[0] if not fixes.empty else None
    verdict = pd.DataFrame([{
        "verdict": said["verdict"], "share": said["share"], "text": said["text"],
        "top_fix": "" if top is None else f"{top['finding']} (saves {top['share_of_run']:.0%})",
        "upgrade": upgrade, "note": note}])
    return verdict, None if fixes.empty else fixes, None if projection.empty else projection
