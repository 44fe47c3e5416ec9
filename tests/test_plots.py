from pathlib import Path

import pandas as pd
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from diag import amdahl, plots
from diag.timing import STAGES
from tests.test_amdahl import constructed

EXAMPLE = Path(__file__).parents[1] / "docs" / "example"


def two_runs():
    return pd.concat([constructed("naive"), constructed("optimized", fetch=0.5, load=2.0)])


def test_every_stage_has_one_colour():
    assert set(plots.STAGE_COLORS) == set(STAGES)


def test_stage_shares_draws_one_bar_per_stage_per_run_in_stage_colours():
    table = amdahl.shares(two_runs())
    fig = plots.plot_stage_shares(table)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(ax.patches) == len(table)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["naive", "optimized"]
    first = ax.patches[0]
    assert to_hex(first.get_facecolor()) == plots.STAGE_COLORS[table["stage"].iloc[0]]
    # bar widths are the stage seconds (in the chosen unit): the naive run sums to its total
    naive = table[table["run"] == "naive"]
    widths = [p.get_width() for p in ax.patches[: len(naive)]]
    assert sum(widths) == pytest.approx(naive["seconds"].sum())


def test_amdahl_curve_has_the_non_compute_floor_and_marks():
    table = amdahl.shares(constructed())
    fig = plots.plot_amdahl(table, marks={"RTX 4070": 1.0, "H100 SXM": 17.0})
    ax = fig.axes[0]
    curve, floor = ax.lines[0], ax.lines[1]
    compute = table.loc[table["stage"].isin(amdahl.GPU_BOUND), "seconds"].sum()
    total = table["seconds"].sum()
    assert curve.get_ydata()[0] == pytest.approx(total)
    assert floor.get_ydata()[0] == pytest.approx(total - compute)
    assert curve.get_xdata()[-1] == pytest.approx(17.0)  # the axis reaches the farthest mark
    assert any("H100 SXM" in t.get_text() for t in ax.texts)


def test_the_waterfall_floats_each_change_and_ends_at_the_optimized_total():
    from tests.report.test_report import comparison

    flow = comparison()["qlora_waterfall"]
    bars = plots.plot_waterfall(flow).axes[0].patches
    assert len(bars) == len(flow)
    assert bars[0].get_height() == pytest.approx(flow["seconds"].iloc[0])
    assert bars[-1].get_height() == pytest.approx(flow["seconds"].iloc[-1])
    for bar, r in zip(bars[1:-1], flow.iloc[1:-1].itertuples()):  # from one level to the next
        assert bar.get_height() == pytest.approx(abs(r.change))
        assert bar.get_y() == pytest.approx(min(r.seconds, r.seconds - r.change))
    assert not fig_texts(bars[0].figure)  # the figures sit in the tick labels, not on bars
    with pytest.raises(ValueError, match="waterfall"):
        plots.plot_waterfall(pd.DataFrame())


def fig_texts(fig):
    return [t for ax in fig.axes for t in ax.texts]


def test_curve_and_upgrade_projection_agree():
    frame = constructed()
    table = amdahl.shares(frame)
    ratio = amdahl.compute_ratio("RTX 4070", "H100 SXM")
    fig = plots.plot_amdahl(table, marks={"H100 SXM": ratio})
    projected = amdahl.upgrade(frame, "RTX 4070", "H100 SXM").set_index("stage")
    (marked,) = [line for line in fig.axes[0].lines if line.get_marker() == "o"]
    assert marked.get_ydata()[0] == pytest.approx(projected.loc["total", "seconds_after"])


def test_advice_never_saves_more_than_the_stage_took():
    extra = pd.DataFrame([{"stage": "load_model", "finding": "page cache", "seconds_saved": 99.0,
                           "evidence": "cold 100 s vs warm 1 s"}])
    found = amdahl.findings(constructed(load=10.0), advice=extra).set_index("finding")
    assert found.loc["page cache", "seconds_saved"] == 10.0
    assert "capped at the run's load_model" in found.loc["page cache", "evidence"]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="shares is empty"):
        plots.plot_stage_shares(pd.DataFrame(columns=["run", "stage", "seconds", "share"]))
    with pytest.raises(ValueError, match="run='other' not in shares"):
        plots.plot_amdahl(amdahl.shares(constructed()), run="other")


def test_notebook_figures_keep_the_users_inline_format(monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell
    from matplotlib.figure import Figure
    from matplotlib_inline.backend_inline import InlineBackend

    shell = InteractiveShell.instance()
    try:
        monkeypatch.setattr(plots._show_in_notebooks, "done", False, raising=False)
        InlineBackend.instance(parent=shell).figure_formats = {"svg"}  # %config ... = {'svg'}
        for formatter in shell.display_formatter.formatters.values():
            formatter.pop(Figure, None)  # as before pyplot is imported: nothing set up yet
        fig = plots._figure()
        fig.add_subplot().plot([0, 1])
        data, _ = shell.display_formatter.format(fig)
        assert "image/svg+xml" in data and "image/png" not in data
        monkeypatch.setattr(plots._show_in_notebooks, "done", False)
        plots._figure()  # a formatter that is already there (pyplot's) is left alone
        assert "image/svg+xml" in shell.display_formatter.format(fig)[0]
    finally:
        InlineBackend.clear_instance()
        InteractiveShell.clear_instance()


def test_the_timeline_stacks_each_step_by_its_stages_per_run():
    run = pd.concat([constructed("naive"), constructed("optimized", fetch=0.5, load=2.0)],
                    ignore_index=True)
    fig = plots.plot_timeline(run)
    assert len(fig.axes) == 2  # one per run
    stepped = run[run["step"].notna() & run["stage"].isin(["data_wait", "compute"])]
    per_step = stepped[stepped["run"] == "naive"].groupby("step")["seconds"].sum()
    tops = {}
    for bar in fig.axes[0].patches:  # each step's bars stack to its total
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    assert tops == pytest.approx(per_step.to_dict())
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["data_wait", "compute"]  # only stages that took time: none invisible


def test_a_decisions_figure_is_drawn_on_its_clock_with_its_choice_marked():
    """The example run's micro-batch decision compared CPU seconds: its figure's bars are the
    CPU-second medians, the chosen point the one solid bar, the default hatched."""
    from diag.decision import by_setting, read

    frame = pd.read_csv(EXAMPLE / "accum.csv")
    chosen = by_setting(read(pd.read_csv(EXAMPLE / "decisions.csv")))["micro_batch"]
    assert chosen.clock == "CPU"
    fig = plots.plot_accum(frame, chosen)
    assert "CPU clock" in fig.get_suptitle()
    step = fig.axes[1]
    bars = [p for p in step.patches if p.get_width() > 0]
    points = list(frame.groupby(["micro_batch", "grad_accum"], sort=False).groups)
    medians = frame.groupby(["micro_batch", "grad_accum"], sort=False)["cpu_s"].median()
    assert [b.get_width() for b in bars] == pytest.approx(list(medians))  # not the wall seconds
    solid = [m for (m, _), b in zip(points, bars) if b.get_alpha() == 1.0]
    assert solid == [chosen.value]
    hatched = [m for (m, _), b in zip(points, bars) if b.get_hatch()]
    assert hatched == [chosen.baseline]
