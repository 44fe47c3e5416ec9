"""`diag trace FILE...`: the stage table from torch.profiler traces (Kineto JSON, .json.gz), one
per rank. A step is a ProfilerStep#N span, else DataLoader `__next__` to the next; in it the first
stage of _ORDER covering a moment takes it; GPU busy, idle, compute, NCCL time as HTA counts them.
`story()` is what trace and attach say: amdahl's verdict, the fixes, the upgrade.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gzip
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from diag import amdahl
from diag.config import TraceConfig
from diag.timing import STAGES, stragglers

GAP_S = 0.001  # a main-thread gap longer than this, with no collective running, is `other`
LOADER = re.compile(r"^enumerate\(DataLoader\)#")
STEP = re.compile(r"^ProfilerStep#\d+$")
COLLECTIVE = re.compile(r"^(nccl|gloo|mpi|ucc):|^c10d::|^record_param_comms$")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_KERNEL = re.compile(r"^nccl.*Kernel")  # HTA's rules for kernels, so the figures agree
NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
_ORDER = ("data_wait", "h2d", "compute", "comm_wait", "other")  # precedence, first wins


@dataclass
class Traced:
    trace: pd.DataFrame  # per rank and stage: seconds, share of the rank's steps, steps
    stages: pd.DataFrame  # the StageTimer frame: stage, seconds, step, rank, node, run
    verdict: pd.DataFrame  # one row: amdahl's verdict, the top fix, the upgrade, notes
    fixes: pd.DataFrame | None  # amdahl.findings (None: no stage worth a fix)
    gpu: pd.DataFrame  # per rank: GPU span, busy, idle, compute and communication seconds
    ranks: pd.DataFrame | None  # stragglers.per_rank (None: one rank)
    stragglers: pd.DataFrame | None  # stragglers.findings: the rank the others waited for
    projection: pd.DataFrame | None  # amdahl.upgrade to the target GPU (None: no --current-gpu)


def load(path: str | Path) -> dict[str, Any]:
    """A Kineto trace's JSON; one ValueError line for a damaged or foreign file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise ValueError(f"{path}: a truncated or damaged .json.gz ({err}); copy the trace "
                         "again") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not complete JSON ({err}); a trace cut short, or not a "
                         "trace") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list) or not any(
            isinstance(e, dict) and e.get("ph") == "X" and "dur" in e for e in events):
        raise ValueError(f"{path}: not a torch.profiler (Kineto) trace: no traceEvents of "
                         "complete events; write one with torch.profiler.profile(...)"
                         ".export_chrome_trace(path) or tensorboard_trace_handler")
    return data


def _events(data: dict[str, Any]) -> pd.DataFrame:
    rows = [(str(e.get("name", "")), str(e.get("cat", "")), float(e["ts"]), float(e["dur"]),
             str(e.get("pid", "")), str(e.get("tid", "")),
             (e.get("args") or {}).get("correlation", -1))
            for e in data["traceEvents"]
            if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]
    frame = pd.DataFrame(rows, columns=["name", "cat", "ts", "dur", "pid", "tid", "correlation"])
    return frame.assign(ts=frame["ts"] / 1e6, end=(frame["ts"] + frame["dur"]) / 1e6)


def _inside(merged: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per point: the last interval starting at or before it, and whether that one holds it."""
    i = np.searchsorted(merged[:, 0], points, side="right") - 1
    return i, (i >= 0) & (points < merged[np.maximum(i, 0), 1]) if len(merged) else \
        np.zeros(len(points), bool)


def _of(events: pd.DataFrame, gap: float = 0.0) -> np.ndarray:
    """The events' intervals as disjoint sorted (start, end) rows; ones closer than gap joined."""
    s, e = events["ts"].to_numpy(float), events["end"].to_numpy(float)
    if not len(s):
        return np.empty((0, 2))
    order = np.argsort(s, kind="stable")
    s, e, reach = s[order], e[order], np.maximum.accumulate(e[order])
    new = np.r_[True, s[1:] > reach[:-1] + gap]
    return np.column_stack([s[new], np.maximum.reduceat(e, np.flatnonzero(new))])


def _seconds(events: pd.DataFrame) -> float:
    return float(np.diff(_of(events)).sum())


def rank_stages(events: pd.DataFrame, rank: int, node: int) -> pd.DataFrame:
    """One rank's StageTimer rows: each step's stage seconds (the first loader step: warmup)."""
    cpu = events[~events["cat"].isin(GPU_CATS)]
    loader = cpu[cpu["name"].str.match(LOADER)]
    marks = next((m for m in (loader, cpu[cpu["name"].str.match(STEP)],
                              cpu[cpu["cat"].isin(("cpu_op", "cuda_runtime"))]) if not m.empty),
                 cpu.iloc[:0])
    if marks.empty:
        raise ValueError("the trace holds no CPU op: record it with "
                         "activities=[ProfilerActivity.CPU, ...]")
    main = cpu[(cpu["pid"] == marks["pid"].mode()[0]) & (cpu["tid"] == marks["tid"].mode()[0])]
    steps = main[main["name"].str.match(STEP)].sort_values("ts")
    warm = steps.empty and len(loader) > 1
    if not steps.empty:
        bounds = steps[["ts", "end"]].to_numpy()
    elif len(loader) > 1:  # the last batch's step has no next to end it: left out
        starts = np.sort(loader["ts"].to_numpy())
        bounds = np.column_stack([starts[:-1], starts[1:]])
    else:
        bounds = np.array([[main["ts"].min(), main["end"].max()]])
    ops = main[~main["name"].isin(STAGES) & ~main["name"].str.match(STEP)
               & (main["cat"] != "Trace")]
    backward = cpu[(cpu["pid"] == main["pid"].iloc[0])
                   & cpu["name"].str.startswith("autograd::engine::evaluate_function")]
    copies = set(events.loc[events["cat"].eq("gpu_memcpy")
                            & events["name"].str.contains("HtoD"), "correlation"])
    spans = {"data_wait": _of(loader),
             "h2d": _of(cpu[cpu["cat"].eq("cuda_runtime") & cpu["correlation"].isin(copies)]),
             "compute": _of(pd.concat([ops, backward]), GAP_S),
             "comm_wait": _of(cpu[cpu["name"].str.match(COLLECTIVE)])}
    cuts = np.unique(np.concatenate([bounds.ravel(), *[s.ravel() for s in spans.values()]]))
    cuts = cuts[(cuts >= bounds[0, 0]) & (cuts <= bounds[-1, 1])]
    mids, widths = (cuts[:-1] + cuts[1:]) / 2, np.diff(cuts)
    step, within = _inside(bounds, mids)
    label = np.full(len(mids), len(_ORDER) - 1)
    for i in reversed(range(len(_ORDER) - 1)):  # the first stage in _ORDER wins
        label[_inside(spans[_ORDER[i]], mids)[1]] = i
    table = pd.DataFrame({"step": step[within], "stage": np.array(_ORDER)[label[within]],
                          "seconds": widths[within]})
    rows = table.groupby(["step", "stage"], as_index=False)["seconds"].sum()
    if warm:  # the loader's first batch: its workers' start-up, kept apart from the steps
        first = rows["step"] == 0
        rows = pd.concat([pd.DataFrame({"step": [pd.NA], "stage": ["warmup"], "seconds": [
            rows.loc[first, "seconds"].sum()]}), rows[~first]], ignore_index=True)
    if steps.empty and len(loader) < 2:
        rows["step"] = pd.NA  # a trace of no steps: one window of stages
    return rows.assign(step=rows["step"].astype("Int64"), rank=rank, node=node, run="trace")[
        ["stage", "seconds", "step", "rank", "node", "run"]]


def gpu_time(events: pd.DataFrame, rank: int) -> dict[str, Any]:
    """A rank's GPU from first kernel to last: busy, idle, compute and NCCL seconds."""
    gpu = events[events["cat"].isin(GPU_CATS)]
    if gpu.empty:
        return {"rank": rank, **dict.fromkeys(["span_s", "busy_s", "idle_s", "compute_s",
                                               "comm_s"], 0.0), "idle_share": float("nan"),
                "note": "no GPU kernels in this trace (a CPU run, or recorded without "
                "ProfilerActivity.CUDA)"}
    span, busy = gpu["end"].max() - gpu["ts"].min(), _seconds(gpu)
    return {"rank": rank, "span_s": span, "busy_s": busy, "idle_s": span - busy,
            "compute_s": _seconds(gpu[~gpu["name"].str.match(NOT_COMPUTE)]),
            "comm_s": _seconds(gpu[gpu["name"].str.match(COMM_KERNEL)]),
            "idle_share": (span - busy) / span, "note": ""}


def story(stages: pd.DataFrame, current_gpu: str, target_gpu: str, note: str = ""
          ) -> tuple[pd.DataFrame, pd.DataFrame | None, pd.DataFrame | None]:
    """(verdict: one row; fixes: amdahl.findings; projection: amdahl.upgrade), None for none."""
    said = amdahl.verdict(amdahl.shares(stages))
    fixes = amdahl.findings(stages)
    projection, upgrade = pd.DataFrame(), "no upgrade projection: " + (
        "name --current-gpu" if not current_gpu else f"{current_gpu} is not in diag's table")
    if current_gpu:
        with contextlib.suppress(ValueError):  # a GPU not in diag's table: no projection
            projection = amdahl.upgrade(stages, current_gpu, target_gpu)
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


def run_trace(cfg: TraceConfig) -> Traced:
    """The stage table, verdict, fixes, GPU time and stragglers of cfg.files (one per rank)."""
    loaded = [load(f) for f in cfg.files]
    events = [_events(d) for d in loaded]
    ranks = [(d.get("distributedInfo") or {}).get("rank", i) for i, d in enumerate(loaded)]
    # traces that cannot be the ranks of one run: refused in one line
    ids = [d.get("trace_id") or i for i, d in enumerate(loaded)]
    sizes = {(d.get("distributedInfo") or {}).get("world_size") for d in loaded} - {None}
    spans = [(f, d["baseTimeNanoseconds"] / 1e9 + e["ts"].min(),
              d["baseTimeNanoseconds"] / 1e9 + e["end"].max())
             for f, d, e in zip(cfg.files, loaded, events) if "baseTimeNanoseconds" in d]
    ended, began = min(spans, key=lambda x: x[2], default=None), max(
        spans, key=lambda x: x[1], default=None)
    at = [dt.datetime.fromtimestamp(x[1], dt.timezone.utc) for x in (ended, began) if x]
    said = ("a trace given twice (the same trace_id)" if len(set(ids)) < len(ids) else
            "a rank given twice" if len(set(ranks)) < len(ranks) else
            f"traces of runs of {sorted(sizes)} ranks" if len(sizes) > 1 else
            f"{ended[0]} (from {at[0]:%H:%M:%S} UTC) ended before {began[0]} (from "
            f"{at[1]:%H:%M:%S} UTC) began: traces of different runs"  # ranks of a run overlap
            if spans and ended[2] < began[1] else "")
    if said:
        raise ValueError(f"TraceConfig.files: {said}, not the ranks of one run")
    hosts = list(dict.fromkeys(str(d.get("host_name", "")) for d in loaded))
    frame = pd.concat([rank_stages(e, r, hosts.index(str(d.get("host_name", ""))))
                       for d, e, r in zip(loaded, events, ranks)], ignore_index=True)
    table = frame.groupby(["rank", "stage"], as_index=False).agg(
        seconds=("seconds", "sum"), steps=("step", "nunique"))
    totals = frame[frame["step"].notna()].groupby("rank")["seconds"].sum()
    # a run-level stage (warmup) has no share of the steps
    table["share"] = (table["seconds"] / table["rank"].map(totals)).where(
        table["stage"].isin(_ORDER))
    verdict, fixes, projection = story(frame, cfg.current_gpu, cfg.target_gpu)
    several = frame["rank"].nunique() > 1
    found = stragglers.findings(frame) if several else None
    return Traced(table, frame, verdict, fixes,
                  pd.DataFrame([gpu_time(e, r) for e, r in zip(events, ranks)]),
                  stragglers.per_rank(frame) if several else None,
                  found if found is not None and not found.empty else None, projection)


def trace(*files: str, **settings: str) -> Traced:
    """`diag trace FILE...` in a notebook; settings: TraceConfig's (current_gpu, target_gpu)."""
    return run_trace(TraceConfig(files=[str(f) for f in files], **settings))
