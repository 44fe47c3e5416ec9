"""A run folder a person can open: one CSV per experiment, summary.json, PNG figures, report.html.

`write(frames)` assembles `runs/<UTC timestamp>/` hidden and renames it into place whole;
`render(DIR)` redraws its figures and page (page.py) from its CSVs, as `diag report DIR` does;
`load(DIR)` reads the frames back with their dtypes.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from diag import amdahl, plots
from diag.decision import chosen
from diag.files import atomic_file, atomic_folder
from diag.machine.device import find_gpu
from diag.report import page
from diag.report.units import seconds
from diag.secrets import redact, redact_frame
from diag.timing import STAGE_FRAME, stragglers  # STAGE_FRAME: the StageTimer frames' key
from diag.timing.distributed import read_spills

_PACKAGES = ("diag", "torch", "transformers", "peft", "bitsandbytes", "huggingface_hub", "boto3",
             "pandas", "numpy")
# Figures other experiments contribute: name -> (plots function, the decision it marks or "")
_PLOTS = {"storage": (plots.plot_storage, ""), "model_load": (plots.plot_model_load, ""),
          "accum": (plots.plot_accum, "micro_batch"), "loader": (plots.plot_loader, "num_workers"),
          "train_losses": (plots.plot_losses, ""), "qlora_losses": (plots.plot_losses, "")}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def write(frames: dict[str, pd.DataFrame], out: str | os.PathLike[str] | None = None, *,
          config: dict[str, Any] | None = None, info: pd.DataFrame | None = None,
          advice: pd.DataFrame | None = None, machine: dict[str, Any] | None = None) -> Path:
    """Write the run folder and render it; return its path."""
    if not frames:
        raise ValueError("frames is empty: nothing to report")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    final, n = Path(out) if out else Path("runs") / stamp, 1
    if out and final.exists() and any(final.iterdir()):
        raise ValueError(f"out={str(final)!r} already holds files; a run is never "
                         "overwritten: name a new folder")
    while not out and final.exists():  # two runs in one second: a new folder each time
        n += 1
        final = Path("runs") / f"{stamp}-{n}"
    with atomic_folder(final) as partial:  # the run appears whole or not at all
        all_frames = frames | ({"info": info} if info is not None else {}) | (
            {"advice": advice} if advice is not None and not advice.empty else {})
        for name, frame in all_frames.items():
            redact_frame(frame).to_csv(partial / f"{name}.csv", index=False)
        summary = _summary(all_frames, config or {}) | ({"machine": machine} if machine else {})
        (partial / "summary.json").write_text(redact(json.dumps(summary, indent=2, default=str)))
        render(partial)
    return final.resolve()


def _summary(frames: dict[str, pd.DataFrame], config: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "experiments": sorted(frames),
        "dtypes": {n: {c: str(t) for c, t in f.dtypes.items()} for n, f in frames.items()},
        "versions": versions(),
        "config": config,
    }
    if "info" in frames:
        summary["device"] = {r.fact: r.value for r in frames["info"].itertuples()}
    if STAGE_FRAME in frames:
        stages = amdahl.shares(frames[STAGE_FRAME])
        found = amdahl.findings(frames[STAGE_FRAME], frames.get("advice"))
        summary["stages"] = stages.to_dict(orient="records")
        summary["findings"] = found.to_dict(orient="records")
        summary["headline"] = headline(stages, found, frames.get("qlora_comparison"),
                                       frames.get("qlora_waterfall"),
                                       frames.get("qlora_projection"), capped(frames))
        summary["top_finding"] = summary["headline"]["top_fix"]
    ranked = _ranked(frames)
    if ranked is not None:  # a DDP run: each rank, and the one the others waited for
        summary["ranks"] = stragglers.per_rank(ranked).to_dict(orient="records")
        summary["stragglers"] = stragglers.findings(ranked).to_dict(orient="records")
    return summary


def _ranked(frames: dict[str, pd.DataFrame]) -> pd.DataFrame | None:
    """The StageTimer frame of a run on several ranks (`run` or `*_stages`), else None."""
    for name in (STAGE_FRAME, *sorted(n for n in frames if n.endswith("_stages"))):
        frame = frames.get(name)
        if frame is not None and {"stage", "step", "rank"} <= set(frame.columns) \
                and frame["rank"].nunique() > 1:
            return frame
    return None


def capped(frames: dict[str, pd.DataFrame]) -> bool:
    """Whether memory capped the micro-batch: the sweep's next point past its largest run OOMed."""
    accum = frames.get("accum")
    if accum is None or "status" not in accum:
        return False
    ran, oom = (accum.loc[accum["status"] == s, "micro_batch"] for s in ("ok", "oom"))
    return not ran.empty and not oom.empty and oom.min() > ran.max()


def headline(stages: pd.DataFrame, found: pd.DataFrame, comparison: pd.DataFrame | None = None,
             flow: pd.DataFrame | None = None, projection: pd.DataFrame | None = None,
             memory_capped: bool = False) -> dict[str, Any]:
    """The verdict, the comparison, the top fix and the projection; `text`: the lines shown."""
    runs = list(dict.fromkeys(stages["run"]))
    first = "naive" if "naive" in runs else runs[0]
    out: dict[str, Any] = amdahl.verdict(stages, first, memory_capped)
    out["verdict_text"] = out.pop("text")
    lines = [f"{first + ' run: ' if len(runs) > 1 else ''}{out['verdict_text']}"]
    if comparison is not None and not comparison.empty:
        row = comparison.iloc[0].to_dict()
        out |= {k: row[k] for k in ("naive_s", "optimized_s", "speedup", "low", "high",
                                    "rounds", "resolved", "clock")}
        out["changed"] = str(row.get("changed") or "").split(",")  # stages the plan's fixes set
        lines.append(row["text"])
    elif {"naive", "optimized"} <= set(runs):  # the toy loop's runs: one each, wall seconds
        total = stages.groupby("run")["seconds"].sum()
        out |= {"naive_s": total["naive"], "optimized_s": total["optimized"],
                "speedup": total["naive"] / total["optimized"], "low": None, "high": None,
                "rounds": 1, "resolved": False, "clock": "wall"}
        lines.append(f"naive {total['naive']:.3g} s -> optimized {total['optimized']:.3g} s: "
                     f"{out['speedup']:.2g}x, one run each: not resolved")
    top = _top(flow, found, first)
    out |= {"top_fix": top[0], "top_fix_saves_s": top[1]}
    if top[0]:
        lines.append(f"top fix: {top[0]}")
    totals = projection[projection["stage"] == "total"] if projection is not None else None
    if totals is not None and not totals.empty:
        priced = totals.dropna(subset=["seconds"])
        out["projection"] = (f"the whole job ({totals['evidence'].iloc[0]}): " + ", ".join(
            f"{r.plan} {seconds(r.seconds)}" for r in priced.itertuples()) if not priced.empty
            else f"the whole job: {totals['evidence'].iloc[0]}")
        lines.append(out["projection"])
    out["text"] = "\n".join(lines)
    return out


def _top(flow: pd.DataFrame | None, found: pd.DataFrame, run: str) -> tuple[str | None, float]:
    """The waterfall's largest saving, else the run's top finding; with what it saves."""
    if flow is not None and not flow.empty:
        fixed = flow[~flow["bar"].isin(["naive", "optimized", "unchanged"])]
        if not fixed.empty:
            best = fixed.loc[fixed["change"].idxmin()]
            unit = "CPU s" if best["clock"] == "CPU" else "s"
            return (f"{best['fixes']} ({best['stage']}: saved {-best['change']:.3g} {unit})",
                    float(-best["change"]))
    mine = found[found["run"] == run] if not found.empty else found
    if mine.empty:
        return None, 0.0
    r, sample = mine.iloc[0], ""
    evidence = str(r.get("evidence", ""))
    if "extrapolated" in evidence:  # priced on a sample: said, with its rounds' spread if given
        rounds = re.search(r"median of \d+ rounds, [^)]*", evidence)
        sample = f"; extrapolated from a sample{f', {rounds.group(0)}' if rounds else ''} " \
                 "(see its evidence)"
    return (f"{r['finding']}: saves {r['seconds_saved']:.3g} s per run "
            f"({r['share_of_run']:.0%} of the {r['run']} run){sample}", float(r["seconds_saved"]))


def load(folder: str | os.PathLike[str]) -> dict[str, pd.DataFrame]:
    """The frames of a run folder, with the dtypes they were written with."""
    folder = Path(folder)
    summary = load_summary(folder)
    frames = {}
    for name in summary["experiments"]:
        frame = pd.read_csv(folder / f"{name}.csv")
        dtypes = summary["dtypes"].get(name, {})
        frames[name] = frame.astype({c: t for c, t in dtypes.items() if c in frame.columns})
    return frames


def load_summary(folder: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} is not a diag run folder: no summary.json "
                                "(runs are written by `python -m diag run`)")
    return json.loads(path.read_text())


def figures(frames: dict[str, pd.DataFrame],
            marks: dict[str, float] | None = None) -> dict[str, Any]:
    """Every figure a run folder gets, from its frames: name -> matplotlib Figure."""
    out = {}
    if STAGE_FRAME in frames:
        stages = amdahl.shares(frames[STAGE_FRAME])
        out["stage_shares"] = plots.plot_stage_shares(stages)
        if frames[STAGE_FRAME]["step"].notna().any():
            out["timeline"] = plots.plot_timeline(frames[STAGE_FRAME])
        out["amdahl"] = plots.plot_amdahl(stages, marks=marks)
    if "qlora_waterfall" in frames and not frames["qlora_waterfall"].empty:
        out["waterfall"] = plots.plot_waterfall(frames["qlora_waterfall"])
    ranked = _ranked(frames)
    if ranked is not None:
        out["ranks"] = plots.plot_ranks(stragglers.per_rank(ranked))
    for name, (plot, setting) in _PLOTS.items():
        if name in frames:
            # a decision's figure: on its clock, its chosen point, default and ties marked
            mark = {"decision": d} if setting and (d := chosen(frames, setting)) else {}
            out[name] = plot(frames[name], **mark)
    return out


def gpu_marks(summary: dict[str, Any]) -> dict[str, float] | None:
    """Amdahl-curve marks: the current GPU at 1x, the target at its ratio (None: not in table)."""
    config, device = summary.get("config", {}), summary.get("device", {})
    current = config.get("current_gpu") or str(device.get("accelerator", ""))
    target = config.get("target_gpu") or "H100 SXM"
    try:
        ratio = amdahl.compute_ratio(current, target)
    except ValueError:
        return None
    return {f"{find_gpu(current).name} (now)": 1.0, find_gpu(target).name: ratio}


def render(folder: str | os.PathLike[str]) -> Path:
    """(Re)draw the PNG figures and report.html of a run folder from its CSVs."""
    folder = Path(folder)
    frames = load(folder)
    summary = load_summary(folder)
    images = {}
    for name, fig in figures(frames, gpu_marks(summary)).items():
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=110)
        images[name] = base64.b64encode(path.read_bytes()).decode("ascii")
    with atomic_file(folder / "report.html") as tmp:
        tmp.write_text(redact(page.page(summary, frames, images)), encoding="utf-8")
    return folder / "report.html"


def run_report(cfg: Any) -> Path:
    """`diag report DIR`: re-render cfg.folder (a DDP job's spills: a new run folder)."""
    folder = Path(cfg.folder)
    if not (folder / "summary.json").is_file() and any(folder.glob("rank-*.partial.csv")):
        return write({STAGE_FRAME: read_spills(folder).assign(run="spilled")},
                     config={"spills": str(folder.resolve())})
    render(folder)
    return folder.resolve()
