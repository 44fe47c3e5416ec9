"""The run folder: one CSV per experiment, summary.json, PNG figures, report.html.

`write(frames)` makes `runs/<UTC timestamp>/` (never overwriting a run: it is assembled in a
hidden temporary folder and renamed into place only when complete), then `render()` draws the
figures and the self-contained HTML page from the CSVs, so `python -m diag report DIR` re-renders
any folder the same way. `load(DIR)` reads the frames back with their dtypes.
"""

from __future__ import annotations

import base64
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
from diag.files import atomic_file, atomic_folder
from diag.report.page import page
from diag.report.units import seconds
from diag.timing import stragglers
from diag.secrets import redact, redact_frame
from diag.timing import STAGE_FRAME  # the key of the StageTimer frames the shares come from

_PACKAGES = ("diag", "torch", "transformers", "peft", "bitsandbytes", "huggingface_hub", "boto3",
             "pandas", "numpy")
# Figures other experiments contribute: plots.<function>(frame) -> Figure, when it exists.
EXPERIMENT_FIGURES = {"storage": "plot_storage", "model_load": "plot_model_load",
                      "accum": "plot_accum",
                      "loader": "plot_loader", "train_losses": "plot_losses"}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _new_folder(out: str | os.PathLike[str] | None) -> Path:
    if out:
        final = Path(out)
        if final.exists() and any(final.iterdir()):
            raise ValueError(f"out={str(final)!r} already holds files; a run is never "
                             "overwritten: name a new folder")
        return final
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    final, n = Path("runs") / stamp, 1
    while final.exists():  # two runs in one second: a new folder each time
        n += 1
        final = Path("runs") / f"{stamp}-{n}"
    return final


def write(frames: dict[str, pd.DataFrame], out: str | os.PathLike[str] | None = None, *,
          config: dict[str, Any] | None = None, info: pd.DataFrame | None = None,
          advice: pd.DataFrame | None = None) -> Path:
    """Write the run folder and render it; return its path.

    frames: experiment name -> tidy frame; frames["run"] (StageTimer frames with a `run`
    column) feeds the stage table, findings and figures. advice: the rows the experiments
    contributed (stage, finding, seconds_saved, evidence), ranked with the stage findings.
    """
    if not frames:
        raise ValueError("frames is empty: nothing to report")
    final = _new_folder(out)
    with atomic_folder(final) as partial:  # the run appears whole or not at all
        all_frames = dict(frames)
        if info is not None:
            all_frames["info"] = info
        if advice is not None and not advice.empty:
            all_frames["advice"] = advice
        for name, frame in all_frames.items():
            redact_frame(frame).to_csv(partial / f"{name}.csv", index=False)
        summary = _summary(all_frames, config or {})
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
        summary["top_finding"] = _top(found)
        summary["headline"] = headline(summary["stages"], summary["findings"],
                                       frames.get("qlora_projection"))
    ranked = _ranked(frames)
    if ranked is not None:  # a DDP run: each rank, and the one the others waited for
        summary["ranks"] = stragglers.per_rank(ranked).to_dict(orient="records")
        summary["stragglers"] = stragglers.findings(ranked).to_dict(orient="records")
    return summary


def _ranked(frames: dict[str, pd.DataFrame]) -> pd.DataFrame | None:
    """The StageTimer frame of a run on several ranks (the `run` frame, or an experiment's
    `*_stages`), None on one process."""
    for name in (STAGE_FRAME, *sorted(n for n in frames if n.endswith("_stages"))):
        frame = frames.get(name)
        if frame is not None and {"stage", "step", "rank"} <= set(frame.columns) \
                and frame["rank"].nunique() > 1:
            return frame
    return None


def headline(stages: list[dict[str, Any]], findings: list[dict[str, Any]] | None = None,
             projection: pd.DataFrame | None = None) -> dict[str, Any] | None:
    """What a reader wants first: naive -> optimized seconds and their ratio, the naive run's
    largest stage, the top fix, and (projection: diag.qlora.projection's frame) what the whole
    job would take under each plan; None without both runs (a single-run folder has no
    comparison). `text` is the one line the CLI prints and the report leads with."""
    totals: dict[str, float] = {}
    for row in stages:
        totals[row["run"]] = totals.get(row["run"], 0.0) + float(row["seconds"])
    if not {"naive", "optimized"} <= set(totals) or not totals["optimized"] > 0:
        return None
    big = max((r for r in stages if r["run"] == "naive"), key=lambda r: float(r["seconds"]))
    top = (findings or [None])[0]
    out = {"naive_s": totals["naive"], "optimized_s": totals["optimized"],
           "speedup": totals["naive"] / totals["optimized"], "largest_stage": big["stage"],
           "largest_stage_share": float(big["share"]),
           "top_fix": top["finding"] + extrapolated(top) if top else None,
           "top_fix_saves_s": float(top["seconds_saved"]) if top else None}
    out["text"] = (f"naive {out['naive_s']:.3g} s -> optimized {out['optimized_s']:.3g} s "
                   f"({out['speedup']:.3g}x); the largest stage was {big['stage']} "
                   f"({out['largest_stage_share']:.0%} of the naive run)")
    totals = projection[projection["stage"] == "total"] if projection is not None else None
    if totals is not None and not totals.empty and totals["predicted_s"].isna().all():
        out["projection"] = f"the whole job: {totals['evidence'].iloc[0]}"
        out["text"] += f"; {out['projection']}"
    elif totals is not None and not totals.empty:
        out["projection"] = (
            f"the whole job ({totals['evidence'].iloc[0]}), projected from the per-token costs "
            "measured here: " + ", ".join(f"{r.plan} {seconds(r.predicted_s)}"
                                          for r in totals.itertuples()))
        out["text"] += f"; {out['projection']}"
    return out


def _top(found: pd.DataFrame) -> str | None:
    if found.empty:
        return None
    r = found.iloc[0]
    return (f"{r['finding']}: saves {r['seconds_saved']:.3g} s per run "
            f"({r['share_of_run']:.0%} of the {r['run']} run){extrapolated(r)}")


def extrapolated(finding: Any) -> str:
    """A finding priced on a sample of the data says so where it is headlined, with the spread
    of its rounds' estimates when its evidence gives one (diag.storage.tax.over_rounds)."""
    evidence = str(finding.get("evidence", ""))
    if "extrapolated" not in evidence:
        return ""
    rounds = re.search(r"median of \d+ rounds, [^)]*", evidence)
    spread = f", {rounds.group(0)}" if rounds else ""
    return f"; extrapolated from a sample{spread} (see its evidence)"


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
        found = amdahl.findings(frames[STAGE_FRAME], frames.get("advice"))
        out["stage_shares"] = plots.plot_stage_shares(stages)
        out["amdahl"] = plots.plot_amdahl(stages, marks=marks)
        first = stages["run"].iloc[0]
        total = float(stages.loc[stages["run"] == first, "seconds"].sum())
        if total > 0:
            out["waterfall"] = plots.plot_waterfall(found[found["run"] == first], total)
    ranked = _ranked(frames)
    if ranked is not None:
        out["ranks"] = plots.plot_ranks(stragglers.per_rank(ranked))
    for name, function in EXPERIMENT_FIGURES.items():
        if name in frames and hasattr(plots, function):
            out[name] = getattr(plots, function)(frames[name])
    return out


def gpu_marks(summary: dict[str, Any]) -> dict[str, float] | None:
    """Amdahl-curve marks: the current GPU (config, else detected) at 1x, the target at its
    dense-peak ratio; None when either is not in diag's table (e.g. a CPU-only machine)."""
    from diag.machine.gpus import find_gpu

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
        tmp.write_text(redact(page(summary, frames, images)), encoding="utf-8")
    return folder / "report.html"


def run_report(cfg: Any) -> Path:
    """`diag report DIR`: re-render cfg.folder (a ReportConfig); returns the run folder. A
    folder of a stopped DDP job's spills (<DIAG_HOME>/ranks/<job>) becomes a new run folder of
    the steps its ranks finished."""
    folder = Path(cfg.folder)
    if not (folder / "summary.json").is_file() and any(folder.glob("rank-*.partial.csv")):
        from diag.timing.spill import read_spills

        return write({STAGE_FRAME: read_spills(folder).assign(run="spilled")},
                     config={"spills": str(folder.resolve())})
    render(folder)
    return folder.resolve()
