"""The notebook panel without a browser: build the widget tree, click Run, read the outputs."""

from __future__ import annotations

import json

import pytest

from diag import widgets
from diag.config import DiagnoseConfig
from tests.conftest import FAKE_HF_TOKEN

# a quick click runs device facts and the toy runs (seconds); every experiment's view is drawn
# by 00_tour in test_notebooks, whose diagnosis reports to a panel through the same hook
FAST = {"storage": False, "model_load": False, "loader": False, "accum": False, "qlora": False}


def _texts(p: widgets.Panel) -> str:
    outputs = [o for w in [p.log, *p.outputs.values()] for o in w.outputs]
    return json.dumps(outputs) + p.status.value


def test_panel_is_a_widget_tree_with_every_control():
    import ipywidgets

    p = widgets.panel(workers="0,2", micro_batches="2,16", plan="naive", quick=True)
    assert isinstance(p.box, ipywidgets.VBox)
    assert {p.source, p.model, p.workers, p.micro_batches, p.plan, p.run, p.progress} <= set(
        w for child in p.box.children for w in (child, *getattr(child, "children", ())))
    cfg = widgets.config_from(p)
    assert (cfg.workers, cfg.micro_batches, cfg.plan, cfg.source, cfg.model) == (
        [0, 2], [2, 16], "naive", "", "")


def test_the_quick_box_shows_what_diag_quick_makes_every_run(monkeypatch):
    monkeypatch.setenv("DIAG_QUICK", "1")
    p = widgets.panel()
    assert p.quick.value is True and widgets.config_from(p).quick_experiments
    p.quick.value = False  # unticked: a full-sized run even with DIAG_QUICK set
    assert not widgets.config_from(p).quick_experiments
    monkeypatch.setenv("DIAG_QUICK", "")
    assert widgets.panel().quick.value is False and widgets.panel(quick=True).quick.value


def test_bad_fields_name_the_field():
    with pytest.raises(ValueError, match="num_workers='0,x'"):
        widgets.panel(workers="0,x")
    with pytest.raises(ValueError, match="plan='fast'"):
        widgets.panel(plan="fast")
    with pytest.raises(ValueError, match=r"DiagnoseConfig.workers=\[-1\]"):
        widgets.panel(workers="-1")
    with pytest.raises(ValueError, match=r"DiagnoseConfig.micro_batches=\[0\]"):
        widgets.panel(micro_batches="0")
    with pytest.raises(ValueError, match="DiagnoseConfig.plan='fast'"):
        DiagnoseConfig(plan="fast")


def test_click_run_draws_each_step_as_it_arrives(tmp_path):
    p = widgets.panel(quick=True, micro_batches="2,16", out=str(tmp_path / "run"), **FAST)
    seen = []
    p.progress.observe(lambda change: seen.append(change["new"]), names="value")
    p.run.click()  # the run goes on in a thread: the kernel still hears Stop meanwhile
    assert p.wait(timeout=120) == str(tmp_path / "run")
    assert p.status.value == f"wrote {tmp_path / 'run'}", _texts(p)
    assert (tmp_path / "run" / "report.html").exists()
    assert p.progress.max == 2 and seen[-2:] == [1, 2]  # one tick per step, as each arrives
    assert {k for o in p.outputs["device facts"].outputs for k in o["data"]} >= {"text/html"}
    runs = p.outputs["naive vs optimized run"].outputs
    assert "naive" in runs[0]["data"]["text/plain"] and "image/png" in runs[1]["data"]
    assert not p.outputs["model load"].outputs  # not run: nothing drawn
    assert not p.run.disabled
    assert FAKE_HF_TOKEN not in _texts(p)


def test_a_failing_step_is_one_redacted_line_and_the_other_steps_go_on(tmp_path, monkeypatch):
    from diag import storage

    # a step fails mid-run (a bad source is refused before any step, by the preflight checks),
    # with the secret in its message and a second line that must not reach the panel
    def boom(cfg):
        raise RuntimeError(f"cannot read s3://bucket/{FAKE_HF_TOKEN}.jsonl\nsecond line")

    monkeypatch.setattr(storage, "run_storage", boom)
    p = widgets.panel(quick=True, out=str(tmp_path / "run"), **(FAST | {"storage": True}))
    p.run.click()
    p.wait(timeout=120)
    (line,) = p.outputs["storage"].outputs
    text = line["data"]["text/plain"]
    assert text.startswith("storage failed: ") and "***" in text and "\n" not in text, text
    assert list(p.failed) == ["storage"]
    # the steps after it ran and drew their views; the run folder was written
    assert "image/png" in p.outputs["naive vs optimized run"].outputs[1]["data"]
    assert p.status.value == f"wrote {tmp_path / 'run'}; 1 step(s) failed: storage"
    assert (tmp_path / "run" / "report.html").exists() and p.progress.value == p.progress.max
    assert "Traceback" not in _texts(p) and not p.log.outputs
    assert FAKE_HF_TOKEN not in _texts(p)
    assert not p.run.disabled and p.stop.disabled


def test_a_bad_field_at_run_time_is_one_line_and_the_button_comes_back():
    p = widgets.panel(quick=True, **FAST)
    p.workers.value = "1,two"
    p.run.click()
    p.wait(timeout=60)
    assert p.status.value == "failed: ValueError: num_workers='1,two': must be whole numbers " \
                             "separated by commas"
    assert not p.run.disabled


def test_stop_ends_the_running_step_and_keeps_the_finished_views(tmp_path, monkeypatch):
    import threading

    from diag import diagnose

    started, ended = threading.Event(), threading.Event()

    def endless_runs(*args, **kwargs):  # a step that would never end by itself
        started.set()
        try:
            while True:
                threading.Event().wait(0.01)
        finally:
            ended.set()  # the step's own clean-up runs

    monkeypatch.setattr(diagnose, "training_runs", endless_runs)
    p = widgets.panel(quick=True, out=str(tmp_path / "run"), **FAST)
    p.run.click()
    assert started.wait(60) and not p.stop.disabled
    p.stop.click()
    p.wait(timeout=30)
    assert not p.thread.is_alive() and ended.is_set()
    assert p.status.value.startswith("stopped after 1 of 2 steps"), p.status.value
    assert p.outputs["device facts"].outputs  # the finished step's view stays
    assert not p.outputs["naive vs optimized run"].outputs
    assert not (tmp_path / "run").exists()  # a stopped run leaves no folder that looks complete
    assert not p.run.disabled and p.stop.disabled
    # and the panel runs again after a Stop
    monkeypatch.undo()
    p.settings["out"] = str(tmp_path / "again")
    p.run.click()
    assert p.wait(timeout=120) == str(tmp_path / "again")


def test_stop_before_a_step_raises_stopped_and_writes_nothing(tmp_path):
    import threading

    from diag.diagnose import run_diagnose
    from diag.runner import Stopped

    stop, seen = threading.Event(), []
    cfg = DiagnoseConfig.default(quick=True, out=str(tmp_path / "run"), **FAST)
    with pytest.raises(Stopped):
        run_diagnose(cfg, on_result=lambda step, frames: (seen.append(step.name), stop.set()),
                     stop=stop)
    assert seen == ["device facts"] and not (tmp_path / "run").exists()


def test_the_panel_tells_a_front_end_without_widgets_what_it_lacks():
    p = widgets.panel(quick=True)
    bundle = p._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == p.box.model_id
    assert "jupyterlab_widgets" in bundle["text/html"] and "VBox(" not in bundle["text/plain"]


def test_nothing_imports_widgets():
    from tests.test_layers import graph

    assert not [src for src, targets in graph().items() if "diag.widgets" in targets]
