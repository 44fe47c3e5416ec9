"""Every figure of diag: a DataFrame in, a matplotlib Figure out; nothing here measures.

Each stage has one colour in every figure (STAGE_COLORS). Figures use the object API (no global
pyplot state), so they render the same in Jupyter, a script and the report.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import pandas as pd

from diag.amdahl import GPU_BOUND
from diag.decision import DATA_WAIT_GOAL
from diag.timing import LOAD_PARTS, STAGES, STEP_STAGES

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from diag.decision import Decision

# Compute is the only share a GPU upgrade shortens: green. Data stages warm colours.
STAGE_COLORS = {
    "fetch_data": "#d62728", "load_model": "#9467bd", "preprocess": "#8c564b", "setup": "#dbdb8d",
    "warmup": "#bcbd22", "train": "#7f7f7f", "checkpoint": "#17becf", "eval": "#aec7e8",
    "data_wait": "#ff7f0e", "h2d": "#e377c2", "compute": "#2ca02c", "other": "#c7c7c7",
    "comm_wait": "#1f77b4", "download": "#9467bd", "read": "#c5b0d5", "quantize": "#f7b6d2",
    "to_device": "#dbdb8d", "tokenizer": "#98df8a", "import": "#e7ba52"}
assert set(STAGE_COLORS) == set(STAGES)


def _show_in_notebooks() -> None:
    """Let Jupyter draw a bare Figure in the user's figure formats, as pyplot would."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is None or getattr(_show_in_notebooks, "done", False):
        return
    from IPython.core.pylabtools import select_figure_formats
    from matplotlib.figure import Figure
    from matplotlib_inline.backend_inline import InlineBackend  # IPython requires it

    _show_in_notebooks.done = True  # type: ignore[attr-defined]
    formatters = shell.display_formatter.formatters
    if any(Figure in f.type_printers for f in formatters.values()):
        return
    cfg = InlineBackend.instance(parent=shell)
    select_figure_formats(shell, cfg.figure_formats, **cfg.print_figure_kwargs)


def _figure(width: float = 8.0, height: float = 3.5) -> Figure:
    from matplotlib.figure import Figure

    _show_in_notebooks()
    return Figure(figsize=(width, height), layout="constrained")


def _axes(width: float, height: float) -> tuple[Figure, Axes]:
    fig = _figure(width, height)
    return fig, fig.add_subplot()


def _time_unit(seconds: float) -> tuple[float, str]:
    return (3600.0, "hours") if seconds >= 7200 else (60.0, "minutes") if seconds >= 120 else \
        (1.0, "seconds")


def _bars(table: pd.DataFrame, labels: list[str], xlabel: str, title: str, width: float,
          height: float, scale_unit: tuple[float, str] | None = None) -> Figure:
    """One stacked bar per row of `table` (stage columns of seconds), its total past its end."""
    longest = float(table.sum(axis=1).max())
    scale, unit = scale_unit or _time_unit(longest)
    fig, ax = _axes(width, height)
    for i, (_, parts) in enumerate(table.iterrows()):
        left = 0.0
        for stage, seconds in parts.dropna().items():
            ax.barh(i, seconds / scale, left=left, color=STAGE_COLORS[stage], edgecolor="white",
                    label=stage if seconds >= 0.01 * longest else f"_{stage}")
            left += seconds / scale
        ax.text(left, i, f"  {left:.3g} {unit}", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel=xlabel.format(unit=unit), title=title)
    ax.set_xlim(0, ax.dataLim.x1 * 1.15)  # room for the totals (an empty stage's edge sticks)
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    # "outside": constrained layout makes room for it, so it is never clipped
    fig.legend(unique.values(), unique.keys(), loc="outside lower center", fontsize=7,
               ncols=min(len(unique), 6), frameon=False)
    return fig


def plot_stage_shares(shares: pd.DataFrame, title: str = "Where the run's time goes") -> Figure:
    """Horizontal stacked bar per run (naive vs optimized side by side) from amdahl.shares()."""
    if shares.empty:
        raise ValueError("shares is empty: nothing to plot")
    runs = list(dict.fromkeys(shares["run"]))
    table = shares.set_index(["run", "stage"])["seconds"].unstack().reindex(
        index=runs, columns=[s for s in STAGES if s in set(shares["stage"])])
    return _bars(table, runs, "wall clock ({unit})", title, 9, 1.4 + 0.5 * len(runs))


def plot_amdahl(shares: pd.DataFrame, run: str | None = None, max_speedup: float = 10.0,
                marks: dict[str, float] | None = None) -> Figure:
    """End-to-end time vs compute speedup, the floor no GPU shortens, `marks` GPUs on it."""
    run = run if run is not None else shares["run"].iloc[0]
    part = shares[shares["run"] == run]
    if part.empty:
        raise ValueError(
            f"run={run!r} not in shares: allowed runs are {sorted(set(shares['run']))}")
    compute = float(part.loc[part["stage"].isin(GPU_BOUND), "seconds"].sum())
    floor = float(part["seconds"].sum()) - compute
    scale, unit = _time_unit(compute + floor)
    marks = marks or {}
    top = max([max_speedup, *marks.values()])
    ks = [1 + i * (top - 1) / 200 for i in range(201)]
    fig, ax = _axes(7, 4)
    ax.plot(ks, [(floor + compute / k) / scale for k in ks], color=STAGE_COLORS["compute"],
            label="end-to-end time")
    ax.axhline(floor / scale, color=STAGE_COLORS["data_wait"], linestyle="--",
               label=f"floor: what no GPU shortens ({floor / scale:.3g} {unit})")
    for name, k in marks.items():
        t = (floor + compute / k) / scale
        ax.plot([k], [t], "o", color="black")
        ax.annotate(f"{name}\n{t:.3g} {unit} ({(compute + floor) / (floor + compute / k):.2f}x)",
                    (k, t), textcoords="offset points", xytext=(5, 8), fontsize=8)
    ax.set(xlabel="compute speedup (x)", ylabel=f"run time ({unit})", ylim=(0, (
        compute + floor) / scale * 1.15), title=f"Amdahl: what a faster GPU buys ({run})")
    ax.legend(fontsize=8, loc="upper right")
    return fig


def plot_waterfall(flow: pd.DataFrame) -> Figure:
    """diag.forecast.story.waterfall's rows: naive, each fix's change, optimized."""
    if flow.empty or not {"bar", "seconds", "change"} <= set(flow.columns):
        raise ValueError("flow must be diag.forecast.story.waterfall's frame")
    clock = str(flow["clock"].iloc[0]) if "clock" in flow.columns else "wall"
    scale, unit = _time_unit(float(flow["seconds"].max()))
    fig, ax = _axes(8, 3.8)
    labels = []
    for i, r in enumerate(flow.itertuples()):  # a total stands on 0; a change floats
        total = r.bar in ("naive", "optimized")
        ax.bar(i, (r.seconds if total else abs(r.change)) / scale,
               bottom=0 if total else min(r.seconds, r.seconds - r.change) / scale,
               color={"naive": "#7f7f7f", "optimized": "#444444"}.get(
                   r.bar, STAGE_COLORS.get(r.stage, "#bbbbbb")))
        labels.append(f"{r.bar}\n" + (f"{r.seconds / scale:.3g}" if total else
                                      f"{r.change / scale:+.3g}"))
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set(ylabel=f"{'CPU ' if clock == 'CPU' else ''}{unit}", title="Naive to optimized, "
           f"stage by stage, as measured ({'CPU' if clock == 'CPU' else 'wall'} seconds)")
    return fig


def plot_storage(frame: pd.DataFrame) -> Figure:
    """Median MB/s per method and cache state as bars, every repeat as a dot (log scale)."""
    if frame.empty or not {"method", "cache_state", "mb_per_s"} <= set(frame.columns):
        raise ValueError("frame must be run_storage().frame: method, cache_state, mb_per_s rows")
    frame = frame[frame["mb_per_s"].notna()]  # a method that could not pull the sample: no bar
    groups = frame.groupby(["method", "cache_state"], sort=False)["mb_per_s"]
    fig, ax = _axes(8, 1.0 + 0.42 * groups.ngroups)
    labels = []
    for i, ((method, state), rates) in enumerate(groups):
        stage = "read" if method == "local_read" else "fetch_data"
        ax.barh(i, rates.median(), color=STAGE_COLORS[stage],
                alpha=0.55 if "warm" in state else 0.9)
        ax.plot(rates, [i] * len(rates), "o", color="black", markersize=3)
        labels.append(f"{method} ({state}): {rates.median():,.0f} MB/s")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="MB/s (log scale; dots are the repeats)",
           title="Object-store pull vs local read")
    return fig


def plot_model_load(frame: pd.DataFrame) -> Figure:
    """One stacked bar per scenario: median seconds of each load part (diag.model_load frame)."""
    from diag.config import MODEL_LOAD_SCENARIOS

    if frame.empty:
        raise ValueError("frame is empty: nothing to plot")
    parts = frame[frame["part"].isin(LOAD_PARTS)]
    table = parts.pivot_table(index="scenario", columns="part", values="seconds", aggfunc="median")
    table = table.reindex(index=[s for s in MODEL_LOAD_SCENARIOS if s in table.index],
                          columns=[p for p in LOAD_PARTS if p in table.columns]).fillna(0.0)
    states = frame.groupby("scenario")["cache_state"].first()
    return _bars(table, [f"{s}\n({states[s]})" if s == "cached_cold" else s for s in table.index],
                 "median load time ({unit})", "Model load: fresh vs cached, by part", 8,
                 1.6 + 0.5 * len(table))


def plot_accum(frame: pd.DataFrame, decision: Decision | None = None) -> Figure:
    """Grad-accum sweep on the decision's clock: tokens/s, seconds per step; points marked."""
    keys = ["micro_batch", "grad_accum"]
    need = {*keys, "tokens_per_step", "seconds_per_step", "cpu_s", "floor_s", "status"}
    if frame.empty or not need <= set(frame.columns):
        raise ValueError("frame must be the accum sweep (run_accum().frame): "
                         + ", ".join(sorted(need)))
    cpu = decision is not None and decision.clock == "CPU"
    col, unit = ("cpu_s", "CPU s") if cpu else ("seconds_per_step", "s")
    status = frame.groupby(keys, sort=False)["status"].first()
    ok = frame[frame["status"] == "ok"]
    tied = {decision.value, *decision.tied} if decision else set()
    fig = _figure(10, 1.6 + 0.45 * len(status))
    rate, step = fig.subplots(1, 2, sharey=True)
    for i, point in enumerate(status.index):
        part = ok[(ok["micro_batch"] == point[0]) & (ok["grad_accum"] == point[1])]
        if part.empty:  # "oom": no bar, the status in its place
            rate.text(0, i, f" {status[point]}", va="center", fontsize=8,
                      color=STAGE_COLORS["fetch_data"])
            continue
        look = {"color": STAGE_COLORS["compute"], "alpha": 1.0 if decision is None or
                point[0] == decision.value else 0.45 if point[0] in tied else 0.15,
                "hatch": "//" if decision and point[0] == decision.baseline else None,
                "edgecolor": "black"}
        for ax, values in ((rate, part["tokens_per_step"] / part[col]), (step, part[col])):
            ax.barh(i, values.median(), **look)
            ax.plot(values, [i] * len(values), ".", color="black", markersize=3)
        floor = part["floor_s"].iloc[0]
        if not cpu and floor == floor:
            step.plot([floor, floor], [i - 0.4, i + 0.4], color="black", linewidth=2,
                      label="floor: 100% of the peak")
    rate.set_yticks(range(len(status)), [f"{m} x {a}" for m, a in status.index], fontsize=8)
    rate.invert_yaxis()
    rate.set(ylabel="micro_batch x grad_accum", xlabel=f"tokens per {unit} (median; repeats: dots)")
    step.set_xlabel(f"{unit} per optimizer step" + ("" if cpu else " (black bar: the floor at "
                                                     "100% of the peak)"))
    if decision is not None:  # the legend of its marks: chosen, default, within noise
        from matplotlib.patches import Patch

        name = decision.setting.replace("_", "-")
        fig.legend(handles=[
            Patch(color=STAGE_COLORS["compute"], label=f"chosen: {name} {decision.value}"),
            Patch(facecolor="white", edgecolor="black", hatch="//",
                  label=f"default: {name} {decision.baseline}"),
            Patch(color=STAGE_COLORS["compute"], alpha=0.45, label="within noise of the fastest")],
            fontsize=7, loc="outside lower center", ncols=3, frameon=False)
    tokens = int(frame["tokens_per_step"].iloc[0])
    fig.suptitle(f"Gradient accumulation at {tokens:,} tokens per step, on the "
                 f"{'CPU' if cpu else 'wall'} clock", fontsize=10)
    return fig


def plot_loader(frame: pd.DataFrame, target_share: float = DATA_WAIT_GOAL,
                decision: Decision | None = None) -> Figure:
    """data_wait share of the step per num_workers per pipeline, the target, the choice."""
    need = {"pipeline", "num_workers", "data_wait_share"}
    if frame.empty or not need <= set(frame.columns):
        raise ValueError("frame must be diag.loader.sweep_workers(): pipeline, num_workers, "
                         "data_wait_share rows")
    ok = frame[frame["data_wait_share"].notna()]
    fig, ax = _axes(8, 3.5)
    for pipeline, part in ok.groupby("pipeline", sort=False):
        medians = part.groupby("num_workers")["data_wait_share"].median() * 100
        line, = ax.plot(medians.index, medians.values, "o-", label=pipeline)
        ax.plot(part["num_workers"], part["data_wait_share"] * 100, ".", color=line.get_color(),
                alpha=0.5)
    if decision is not None:
        ax.axvline(decision.value, color="black", alpha=0.15, linewidth=10,
                   label=f"chosen: num_workers {decision.value} (default {decision.baseline})")
    ax.axhline(target_share * 100, color="black", linestyle="--", linewidth=1,
               label=f"target {target_share:.0%}")
    step = frame["step_s"].median() if "step_s" in frame else float("nan")
    ax.set(xticks=sorted(frame["num_workers"].unique()), xlabel="DataLoader num_workers",
           ylabel="data_wait, % of the step", ylim=(0, None),
           title=f"Does the loader keep up with a {step * 1e3:.3g} ms step?")
    ax.legend(fontsize=8, frameon=False)
    return fig


def plot_ranks(per_rank: pd.DataFrame, title: str = "Per rank: where a step's time goes") -> Figure:
    """One stacked bar per rank of diag.timing.stragglers.per_rank(): the straggler shows."""
    if per_rank.empty:
        raise ValueError("per_rank is empty: nothing to plot")
    stages = ["data_wait", "h2d", "compute", "comm_wait", "other"]
    table = per_rank[[f"{s}_s" for s in stages]].set_axis(stages, axis=1)
    return _bars(table, [f"{r.run + ' ' if r.run else ''}rank {r.rank} (node {r.node})"
                         for r in per_rank.itertuples()],
                 "milliseconds per step (median of each stage)", title, 9,
                 1.4 + 0.4 * len(per_rank), (1e-3, "ms"))


def plot_losses(losses: pd.DataFrame) -> Figure:
    """Train and held-out loss against trained tokens, one colour per run."""
    if "split" not in losses.columns and {"run", "step", "loss"} <= set(losses.columns):
        losses = losses.assign(split="train", trained_tokens=losses["step"])  # a comparison's
    if losses.empty or not {"run", "split", "loss", "trained_tokens"} <= set(losses.columns):
        raise ValueError("losses must be diag train's: run, split, loss, trained_tokens rows")
    fig, ax = _axes(8, 3.5)
    for i, (run, part) in enumerate(losses.groupby("run", sort=False)):
        for split, mine in part.sort_values("trained_tokens").groupby("split", sort=False):
            ax.plot(mine["trained_tokens"], mine["loss"], "-" if split == "train" else "o-",
                    color=f"C{i}", markersize=4, alpha=0.45 if split == "train" else 1.0,
                    label=f"{run} {split}")
    ax.set(xlabel="trained tokens", ylabel="loss",
           title="Train and held-out loss against trained tokens")
    ax.legend(fontsize=8, frameon=False)
    return fig


def plot_timeline(stages: pd.DataFrame) -> Figure:
    """Each run's steps over time, stacked by step stage (one rank): drift shows."""
    from matplotlib.ticker import MaxNLocator

    stepped = stages[stages["step"].notna() & stages["stage"].isin(STEP_STAGES)]
    if stepped.empty:
        raise ValueError("stages holds no step-level rows (data_wait, compute, ...)")
    if "rank" in stepped.columns:
        stepped = stepped[stepped["rank"] == stepped["rank"].min()]
    per = stepped.assign(run=stepped.get("run", "run")).pivot_table(
        "seconds", ["run", "step"], "stage", "sum", fill_value=0.0, sort=False)
    runs = list(dict.fromkeys(per.index.get_level_values("run")))
    scale, unit = _time_unit(float(per.sum(axis=1).max()))
    fig = _figure(8, 1.2 + 1.6 * len(runs))
    for i, run in enumerate(runs):
        ax, mine, bottom = fig.add_subplot(len(runs), 1, i + 1), per.loc[run] / scale, 0.0
        for stage in (s for s in STEP_STAGES if s in mine.columns and mine[s].sum() > 0):
            ax.bar(mine.index.astype(int), mine[stage], bottom=bottom, color=STAGE_COLORS[stage],
                   label=stage)
            bottom = bottom + mine[stage]
        ax.set_ylabel(f"{run}\n{unit}", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.axes[-1].set_xlabel("step")
    fig.axes[0].set_title("Each step's time by stage (wall seconds)")
    return fig
