"""Every figure of diag: a DataFrame in, a matplotlib Figure out; nothing here measures.

Each stage has one colour in every figure (STAGE_COLORS). Figures use the object API (no global
pyplot state), so they render the same in Jupyter, a script and the report.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import pandas as pd

from diag.decision import DATA_WAIT_GOAL
from diag.timing import STAGES, STEP_STAGES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Compute is the only share a GPU upgrade shortens: green. Data stages warm colours.
STAGE_COLORS = {
    "fetch_data": "#d62728", "load_model": "#9467bd", "preprocess": "#8c564b",
    "setup": "#dbdb8d", "warmup": "#bcbd22", "train": "#7f7f7f", "checkpoint": "#17becf",
    "eval": "#aec7e8",
    "data_wait": "#ff7f0e", "h2d": "#e377c2", "compute": "#2ca02c", "other": "#c7c7c7",
    "comm_wait": "#1f77b4",
    "download": "#9467bd", "read": "#c5b0d5", "quantize": "#f7b6d2", "to_device": "#dbdb8d",
    "tokenizer": "#98df8a", "import": "#e7ba52",
}
assert set(STAGE_COLORS) == set(STAGES)


def _show_in_notebooks() -> None:
    """Let Jupyter draw a bare Figure in the user's InlineBackend.figure_formats, as pyplot
    would; a formatter already there is left alone."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(_show_in_notebooks, "done", False):
        return
    from IPython.core.pylabtools import print_figure, select_figure_formats
    from matplotlib.figure import Figure

    _show_in_notebooks.done = True  # type: ignore[attr-defined]
    formatters = shell.display_formatter.formatters
    if any(Figure in f.type_printers for f in formatters.values()):
        return
    try:
        from matplotlib_inline.backend_inline import InlineBackend
    except ImportError:  # no inline backend installed: PNG, as it would default to
        formatters["image/png"].for_type(
            Figure, lambda fig: print_figure(fig, "png", bbox_inches="tight", dpi=100))
        return
    cfg = InlineBackend.instance(parent=shell)
    select_figure_formats(shell, cfg.figure_formats, **cfg.print_figure_kwargs)


def _figure(width: float = 8.0, height: float = 3.5) -> Figure:
    from matplotlib.figure import Figure

    _show_in_notebooks()
    return Figure(figsize=(width, height), layout="constrained")


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "hours"
    if seconds >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def plot_stage_shares(shares: pd.DataFrame, title: str = "Where the run's time goes") -> Figure:
    """Horizontal stacked bar per run (naive vs optimized side by side) from amdahl.shares()."""
    if shares.empty:
        raise ValueError("shares is empty: nothing to plot")
    runs = list(dict.fromkeys(shares["run"]))
    longest = shares.groupby("run")["seconds"].sum().max()
    scale, unit = _time_unit(longest)
    fig = _figure(9, 1.2 + 0.7 * len(runs))
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        left = 0.0
        for r in shares[shares["run"] == run].itertuples():
            width = r.seconds / scale
            ax.barh(i, width, left=left, color=STAGE_COLORS[r.stage], edgecolor="white",
                    label=r.stage)
            if r.seconds >= 0.08 * longest:  # room for a label on the drawn bar
                ax.text(left + width / 2, i, f"{r.stage}\n{r.share:.0%}", ha="center",
                        va="center", fontsize=7)
            left += width
        ax.text(left, i, f"  {left:.3g} {unit}", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), runs)
    ax.invert_yaxis()
    ax.set_xlabel(f"wall clock ({unit})")
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, ncols=min(len(unique), 6),
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(runs) < 3 else -0.2),
              frameon=False)
    ax.margins(x=0.12)
    return fig


def plot_amdahl(shares: pd.DataFrame, run: str | None = None, max_speedup: float = 10.0,
                marks: dict[str, float] | None = None) -> Figure:
    """End-to-end time vs compute speedup 1..max_speedup x; the floor is what no GPU shortens.

    marks: {"RTX 4070 (now)": 1.0, "H100 SXM": 17.0} places each GPU on the curve.
    """
    run = run if run is not None else shares["run"].iloc[0]
    part = shares[shares["run"] == run]
    if part.empty:
        raise ValueError(
            f"run={run!r} not in shares: allowed runs are {sorted(set(shares['run']))}")
    from diag.amdahl import GPU_BOUND

    compute = float(part.loc[part["stage"].isin(GPU_BOUND), "seconds"].sum())
    floor = float(part["seconds"].sum()) - compute
    scale, unit = _time_unit(compute + floor)
    marks = marks or {}
    top = max([max_speedup, *marks.values()])
    ks = [1 + i * (top - 1) / 200 for i in range(201)]
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    ax.plot(ks, [(floor + compute / k) / scale for k in ks], color=STAGE_COLORS["compute"],
            label="end-to-end time")
    ax.axhline(floor / scale, color=STAGE_COLORS["data_wait"], linestyle="--",
               label=f"floor: what no GPU shortens ({floor / scale:.3g} {unit})")
    for name, k in marks.items():
        t = (floor + compute / k) / scale
        ax.plot([k], [t], "o", color="black")
        ax.annotate(f"{name}\n{t:.3g} {unit} ({(compute + floor) / (floor + compute / k):.2f}x)",
                    (k, t), textcoords="offset points", xytext=(5, 8), fontsize=8)
    ax.set_xlabel("compute speedup (x)")
    ax.set_ylabel(f"run time ({unit})")
    ax.set_ylim(0, (compute + floor) / scale * 1.15)
    ax.set_title(f"Amdahl: what a faster GPU buys ({run})")
    ax.legend(fontsize=8, loc="upper right")
    return fig


def plot_waterfall(flow: pd.DataFrame) -> Figure:
    """From the naive total through each stage a fix changed (its measured change) and the
    stages no fix changed to the optimized total (diag.forecast.story.waterfall's rows)."""
    if flow.empty or not {"bar", "seconds", "change"} <= set(flow.columns):
        raise ValueError("flow must be diag.forecast.story.waterfall's frame")
    clock = str(flow["clock"].iloc[0]) if "clock" in flow.columns else "wall"
    scale, unit = _time_unit(float(flow["seconds"].max()))
    fig = _figure(8, 3.8)
    ax = fig.add_subplot()
    labels = []
    for i, r in enumerate(flow.itertuples()):
        if r.bar in ("naive", "optimized"):
            ax.bar(i, r.seconds / scale, color="#7f7f7f" if r.bar == "naive" else "#444444")
            labels.append(f"{r.bar}\n{r.seconds / scale:.3g}")
            continue
        low = min(r.seconds, r.seconds - r.change)
        ax.bar(i, abs(r.change) / scale, bottom=low / scale,
               color=STAGE_COLORS.get(r.stage, "#bbbbbb"))
        labels.append(f"{r.bar}\n{r.change / scale:+.3g}")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel(f"{'CPU ' if clock == 'CPU' else ''}{unit}")
    ax.set_title("Naive to optimized, stage by stage, as measured "
                 f"({'CPU' if clock == 'CPU' else 'wall'} seconds)")
    return fig


def plot_storage(frame: pd.DataFrame) -> Figure:
    """Median MB/s per method and cache state (bars), every measured repeat as a dot (log scale)."""
    if frame.empty or not {"method", "cache_state", "mb_per_s"} <= set(frame.columns):
        raise ValueError("frame must be run_storage().frame: method, cache_state, mb_per_s rows")
    frame = frame[frame["mb_per_s"].notna()]  # a method that could not pull the sample: no bar
    groups = list(dict.fromkeys(zip(frame["method"], frame["cache_state"])))
    fig = _figure(8, 1.0 + 0.42 * len(groups))
    ax = fig.add_subplot()
    for i, (method, state) in enumerate(groups):
        rates = frame.loc[(frame["method"] == method) & (frame["cache_state"] == state), "mb_per_s"]
        stage = "read" if method == "local_read" else "fetch_data"
        median = float(rates.median())
        ax.barh(i, median, color=STAGE_COLORS[stage], alpha=0.55 if "warm" in state else 0.9)
        ax.plot(rates, [i] * len(rates), "o", color="black", markersize=3)
        ax.text(median, i, f"  {median:,.0f} MB/s", va="center", fontsize=8)
    ax.set_yticks(range(len(groups)), [f"{m} ({s})" for m, s in groups], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("MB/s (log scale; dots are the repeats)")
    ax.set_title("Object-store pull vs local read")
    ax.margins(x=0.25)
    return fig


def plot_model_load(frame: pd.DataFrame) -> Figure:
    """One stacked bar per scenario: median seconds of each load part (diag.model_load frame)."""
    from diag.config import MODEL_LOAD_SCENARIOS
    from diag.timing import LOAD_PARTS

    if frame.empty:
        raise ValueError("frame is empty: nothing to plot")
    parts = frame[frame["part"].isin(LOAD_PARTS)]
    table = parts.pivot_table(index="scenario", columns="part", values="seconds", aggfunc="median")
    table = table.reindex(index=[s for s in MODEL_LOAD_SCENARIOS if s in table.index],
                          columns=[p for p in LOAD_PARTS if p in table.columns]).fillna(0.0)
    scale, unit = _time_unit(float(table.sum(axis=1).max()))
    states = frame.groupby("scenario")["cache_state"].first()
    fig = _figure(8, 1.4 + 0.6 * len(table))
    ax = fig.add_subplot()
    for i, scenario in enumerate(table.index):
        left = 0.0
        for part, seconds in table.loc[scenario].items():
            ax.barh(i, seconds / scale, left=left, color=STAGE_COLORS[part], edgecolor="white",
                    label=part)
            left += seconds / scale
        ax.text(left, i, f"  {left:.3g} {unit}", va="center", fontsize=8)
    labels = [f"{s}\n({states[s]})" if s == "cached_cold" else s for s in table.index]
    ax.set_yticks(range(len(table)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"median load time ({unit})")
    ax.set_title("Model load: fresh vs cached, by part")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, ncols=len(unique), frameon=False,
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(table) > 2 else -0.4))
    ax.margins(x=0.15)
    return fig


def plot_accum(frame: pd.DataFrame) -> Figure:
    """Grad-accum sweep: median tokens/s per micro_batch x grad_accum (MFU on the bar, OOM
    marked), and median seconds per step beside the floor (the step at 100% of the peak)."""
    need = {"micro_batch", "grad_accum", "tokens_per_s", "seconds_per_step", "floor_s", "status"}
    if frame.empty or not need <= set(frame.columns):
        raise ValueError("frame must be the accum sweep (sweep_grad_accum): "
                         + ", ".join(sorted(need)))
    points = list(dict.fromkeys(zip(frame["micro_batch"], frame["grad_accum"])))
    fig = _figure(10, 1.4 + 0.45 * len(points))
    rate, step = fig.subplots(1, 2, sharey=True)
    for i, (m, a) in enumerate(points):
        rows = frame[(frame["micro_batch"] == m) & (frame["grad_accum"] == a)]
        if (rows["status"] != "ok").all():
            for ax in (rate, step):
                ax.text(0, i, f" {rows['status'].iloc[0]}", va="center", fontsize=8,
                        color=STAGE_COLORS["fetch_data"])
            continue
        ok = rows[rows["status"] == "ok"]
        tps, sps = float(ok["tokens_per_s"].median()), float(ok["seconds_per_step"].median())
        rate.barh(i, tps, color=STAGE_COLORS["compute"])
        mfu = ok["mfu"].median() if "mfu" in ok else math.nan
        rate.text(tps, i, f"  {tps:,.0f}" + (f"  MFU {mfu:.1%}" if mfu == mfu else ""),
                  va="center", fontsize=8)
        step.barh(i, sps, color=STAGE_COLORS["compute"], alpha=0.8)
        floor = float(ok["floor_s"].iloc[0])
        if floor == floor:
            step.plot([floor, floor], [i - 0.4, i + 0.4], color="black", linewidth=2,
                      label="floor: 100% of the peak")
        step.text(sps, i, f"  {sps:.3g} s", va="center", fontsize=8)
    rate.set_yticks(range(len(points)), [f"{m} x {a}" for m, a in points], fontsize=8)
    rate.invert_yaxis()
    rate.set_ylabel("micro_batch x grad_accum")
    rate.set_xlabel("tokens/s (median)")
    step.set_xlabel("seconds per optimizer step (median)")
    handles, labels = step.get_legend_handles_labels()
    if handles:
        step.legend(handles[:1], labels[:1], fontsize=7, loc="lower right")
    for ax in (rate, step):
        ax.margins(x=0.35)
    tokens = int(frame["tokens_per_step"].iloc[0]) if "tokens_per_step" in frame else 0
    fig.suptitle(f"Gradient accumulation at {tokens:,} tokens per step", fontsize=10)
    return fig


def plot_loader(frame: pd.DataFrame, target_share: float = DATA_WAIT_GOAL) -> Figure:
    """data_wait share of the step per num_workers, one line per pipeline (diag.loader sweep).

    Lines join the medians, dots are the repeats; the dashed line is the target share the
    recommendation must stay under. Failed settings are left out (their error is in the table).
    """
    need = {"pipeline", "num_workers", "data_wait_share"}
    if frame.empty or not need <= set(frame.columns):
        raise ValueError("frame must be diag.loader.sweep_workers(): pipeline, num_workers, "
                         "data_wait_share rows")
    ok = frame[frame["data_wait_share"].notna()]
    fig = _figure(8, 3.5)
    ax = fig.add_subplot()
    for pipeline, part in ok.groupby("pipeline", sort=False):
        medians = part.groupby("num_workers")["data_wait_share"].median() * 100
        line, = ax.plot(medians.index, medians.values, "o-", label=pipeline)
        ax.plot(part["num_workers"], part["data_wait_share"] * 100, ".", color=line.get_color(),
                alpha=0.5)
    ax.axhline(target_share * 100, color="black", linestyle="--", linewidth=1,
               label=f"target {target_share:.0%}")
    ax.set_xticks(sorted(frame["num_workers"].unique()))
    ax.set_xlabel("DataLoader num_workers")
    ax.set_ylabel("data_wait, % of the step")
    step = frame["step_s"].median() if "step_s" in frame else float("nan")
    ax.set_title(f"Does the loader keep up with a {step * 1e3:.3g} ms step?")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, frameon=False)
    return fig


def plot_ranks(per_rank: pd.DataFrame, title: str = "Per rank: where a step's time goes") -> Figure:
    """One stacked bar per rank (per run): seconds per step in data_wait, h2d, compute,
    comm_wait, other, from diag.timing.stragglers.per_rank(); the straggler is the longest bar
    without comm_wait, the ranks that wait for it carry it as comm_wait."""
    if per_rank.empty:
        raise ValueError("per_rank is empty: nothing to plot")
    stages = ("data_wait", "h2d", "compute", "comm_wait", "other")
    labels = [f"{r.run} rank {r.rank} (node {r.node})" if r.run
              else f"rank {r.rank} (node {r.node})"
              for r in per_rank.itertuples()]
    fig = _figure(9, 1.2 + 0.45 * len(per_rank))
    ax = fig.add_subplot()
    for i, row in enumerate(per_rank.itertuples()):
        left = 0.0
        for stage in stages:
            width = float(getattr(row, f"{stage}_s")) * 1000
            ax.barh(i, width, left=left, color=STAGE_COLORS[stage], edgecolor="white",
                    label=stage)
            left += width
        ax.text(left, i, f"  {left:.3g} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds per step (median of each stage)")
    ax.set_title(title)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, ncols=len(unique), frameon=False,
              loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.margins(x=0.12)
    return fig


def plot_losses(losses: pd.DataFrame) -> Figure:
    """Train loss (line) and held-out eval loss (dots joined) against trained tokens, one colour
    per run (diag.qlora.run_train's `losses`; the naive and optimized runs side by side)."""
    if "split" not in losses.columns and {"run", "step", "loss"} <= set(losses.columns):
        losses = losses.assign(split="train", trained_tokens=losses["step"])  # a comparison's
    if losses.empty or not {"run", "split", "loss", "trained_tokens"} <= set(losses.columns):
        raise ValueError("losses must be diag train's: run, split, loss, trained_tokens rows")
    fig = _figure(8, 3.5)
    ax = fig.add_subplot()
    for i, (run, part) in enumerate(losses.groupby("run", sort=False)):
        for split, style in (("train", "-"), ("eval", "o-")):
            mine = part[part["split"] == split].sort_values("trained_tokens")
            ax.plot(mine["trained_tokens"], mine["loss"], style, color=f"C{i}", markersize=4,
                    alpha=0.45 if split == "train" else 1.0, label=f"{run} {split}")
    ax.set_xlabel("trained tokens")
    ax.set_ylabel("loss")
    ax.set_title("Train and held-out loss against trained tokens")
    ax.legend(fontsize=8, frameon=False)
    return fig


def plot_timeline(stages: pd.DataFrame) -> Figure:
    """Each run's steps over time, each bar stacked by its step-level stages (a StageTimer
    frame's rows with step numbers; one rank's clock): drift and outliers show."""
    stepped = stages[stages["step"].notna() & stages["stage"].isin(STEP_STAGES)]
    if stepped.empty:
        raise ValueError("stages holds no step-level rows (data_wait, compute, ...)")
    if "rank" in stepped.columns:
        stepped = stepped[stepped["rank"] == stepped["rank"].min()]
    runs = list(dict.fromkeys(stepped["run"] if "run" in stepped.columns else ["run"]))
    fig = _figure(8, 1.2 + 1.6 * len(runs))
    per = stepped.pivot_table("seconds", ["run", "step"] if "run" in stepped.columns else "step",
                              "stage", "sum", fill_value=0.0)
    scale, unit = _time_unit(float(per.sum(axis=1).max()))
    for i, run in enumerate(runs):
        ax = fig.add_subplot(len(runs), 1, i + 1)
        mine = per.loc[run] if "run" in stepped.columns else per
        bottom = [0.0] * len(mine)
        for stage in (s for s in STEP_STAGES if s in mine.columns and mine[s].sum() > 0):
            ax.bar(mine.index.astype(int), mine[stage] / scale, bottom=bottom,
                   color=STAGE_COLORS[stage], label=stage)
            bottom = [b + v / scale for b, v in zip(bottom, mine[stage])]
        ax.set_ylabel(f"{run}\n{unit}", fontsize=8)
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.axes[-1].set_xlabel("step")
    fig.axes[0].set_title("Each step's time by stage (wall seconds)")
    return fig
