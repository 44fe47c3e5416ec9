"""What the model-load frame says a job should change: medians per scenario and part, advice, and
the model_cache decision. The `import` part is the same in every scenario, so it cancels out."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from diag.config import MODEL_LOAD_SCENARIOS as SCENARIOS
from diag.decision import Decision, MeasuredOn
from diag.machine.disks import is_network
from diag.timing import LOAD_PARTS

if TYPE_CHECKING:
    import pandas as pd


def medians(frame: pd.DataFrame) -> pd.DataFrame:
    """Median seconds per scenario (rows) and part (columns), load_model last."""
    table = frame.pivot_table(index="scenario", columns="part", values="seconds", aggfunc="median")
    order = [p for p in (*LOAD_PARTS, "load_model", "from_pretrained") if p in table.columns]
    return table.reindex(index=[s for s in SCENARIOS if s in table.index], columns=order)


def advice(frame: pd.DataFrame) -> pd.DataFrame:
    """Advice rows (stage, finding, seconds_saved, evidence) for amdahl.findings(advice=...)."""
    import pandas as pd

    cols = ["stage", "finding", "seconds_saved", "evidence"]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    med, rows = medians(frame), []
    runs = frame.groupby("scenario")["repeat"].nunique()

    def load(s: str) -> str:
        return f"{s} load_model median {med.loc[s, 'load_model']:.3g} s over {runs[s]} runs"

    def add(finding: str, saved: float, evidence: str) -> None:
        if saved > 0:
            rows.append({"stage": "load_model", "finding": finding, "seconds_saved": saved,
                         "evidence": f"model_load: {evidence}"})

    if {"fresh", "cached"} <= set(med.index):
        got = frame[(frame.scenario == "fresh") & (frame.part == "download")]
        add("Keep the HF cache (HF_HUB_CACHE, default HF_HOME/hub) on a persistent local NVMe "
            "volume, so each run loads the model from disk instead of downloading it; where a "
            "download can't be avoided, HF_XET_HIGH_PERFORMANCE=1 lets hf_xet use every core and "
            "more bandwidth for Xet-stored repos (the embedded hub serves no Xet: not measured)",
            med.loc["fresh", "load_model"] - med.loc["cached", "load_model"],
            f"{load('fresh')} (download {got['bytes'].median() / 1e6:.4g} MB at "
            f"{got['mb_per_s'].median():.4g} MB/s) vs {load('cached')}")
    if {"cached", "cached_offline"} <= set(med.index):
        add("Set HF_HUB_OFFLINE=1 once the model is cached: no revision check against the hub",
            med.loc["cached", "download"] - med.loc["cached_offline", "download"],
            f"cached download (revision check) median {med.loc['cached', 'download']:.3g} s "
            f"vs cached_offline {med.loc['cached_offline', 'download']:.3g} s")
    cold = frame[frame.scenario == "cached_cold"]
    if ("cached" in med.index and not cold.empty
            and cold["cache_state"].str.startswith("cold").all()):
        add("Keep the model in the page cache between runs (same machine, enough free RAM): "
            "a cold read comes from the disk",
            med.loc["cached_cold", "load_model"] - med.loc["cached", "load_model"],
            f"{load('cached_cold')} (read {med.loc['cached_cold', 'read']:.3g} s) vs "
            f"{load('cached')} (read {med.loc['cached', 'read']:.3g} s)")
        if frame["cache_disk"].map(is_network).any():
            read = cold[cold.part == "read"].median(numeric_only=True)
            add("The HF cache is on network storage: every cold load reads it at network speed; "
                "put HF_HUB_CACHE on local NVMe (an upper bound)", float(read["seconds"]),
                f"cached_cold read median {read['seconds']:.3g} s at {read['mb_per_s']:.4g} MB/s "
                "from a network filesystem")
    return pd.DataFrame(rows, columns=cols)


def decide(frame: pd.DataFrame | None) -> tuple[Decision, ...]:
    """`model_cache`: "persistent" unless fresh loads (less their import) resolve faster."""
    from diag.noise import compare, spread

    fresh, cached = _loads(frame, "fresh"), _loads(frame, "cached")
    if not fresh or not cached:
        why = ("model_load frame absent" if frame is None or frame.empty else
               "no fresh or cached load_model row ran")
        return (Decision.default("model_cache", "persistent",
                                 f"{why}: keep a persistent HF cache", source="model_load"),)
    rows = frame[frame["scenario"].isin(["fresh", "cached"])
                 & frame["part"].isin(["load_model", "import"])]
    gap = compare(cached, fresh)
    choice = {"a": "persistent", "b": "empty"}.get(gap.faster or "", "persistent")
    imported = float(frame.loc[frame["part"] == "import", "seconds"].median())
    model = str(frame["model"].iloc[0]) if "model" in frame.columns else ""
    device = str(frame["device"].dropna().iloc[0]) if frame["device"].notna().any() else ""
    cached_s, fresh_s = statistics.median(cached), statistics.median(fresh)
    sides = (cached, fresh) if choice == "persistent" else (fresh, cached)  # the chosen first
    return (Decision.from_rows(
        "model_cache", choice, f"cached load {cached_s:.3g} s vs fresh {fresh_s:.3g} s per "
        f"start, the import ({imported:.3g} s, paid by both) apart: {gap.describe()} -> "
        f"{choice}" + ("" if gap.resolved else " (the default)"), rows, source="model_load",
        basis="measured" if gap.resolved else "default",
        measured_on=MeasuredOn(model=model, precision="nf4", device=device,
                               step="a load process's model load (download, read, quantize, "
                                    "to device, tokenizer), its import apart"),
        baseline="empty", stage="load_model", per="start", baseline_s=fresh_s,
        chosen_s=cached_s if choice == "persistent" else fresh_s, resolved=gap.resolved,
        samples=tuple(map(len, sides)), spread=tuple(map(spread, sides))),)


def _loads(frame: pd.DataFrame | None, scenario: str) -> list[float]:
    """Each repeat's load_model seconds less its import ([] if none ran)."""
    if frame is None or frame.empty:
        return []
    rows = frame[frame["scenario"] == scenario]
    loads = rows.loc[rows["part"] == "load_model", "seconds"].to_numpy(float)
    imports = rows.loc[rows["part"] == "import", "seconds"].to_numpy(float)
    return [float(s) for s in (loads - imports if len(imports) == len(loads) else loads)]
