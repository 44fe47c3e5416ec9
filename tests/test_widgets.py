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
    p.run.click()
    assert p.status.value == f"wrote {tmp_path / 'run'}", _texts(p)
    assert (tmp_path / "run" / "report.html").exists()
    assert p.progress.max == 2 and seen[-2:] == [1, 2]  # one tick per step, as each arrives
    assert {k for o in p.outputs["device facts"].outputs for k in o["data"]} >= {"text/html"}
    runs = p.outputs["naive vs optimized run"].outputs
    assert "naive" in runs[0]["data"]["text/plain"] and "image/png" in runs[1]["data"]
    assert not p.outputs["model load"].outputs  # not run: nothing drawn
    assert not p.run.disabled
    assert FAKE_HF_TOKEN not in _texts(p)


def test_a_failing_run_is_shown_redacted_and_the_button_comes_back(tmp_path):
    # a source that names the secret: the error message would carry it
    p = widgets.panel(source=f"s3://no-such-bucket/{FAKE_HF_TOKEN}.jsonl", quick=True,
                      out=str(tmp_path / "run"), **(FAST | {"storage": True}))
    p.run.click()
    assert p.status.value.startswith("failed: ") and "***" in p.status.value, p.status.value
    assert p.log.outputs and "Traceback" in p.log.outputs[0]["text"]
    assert FAKE_HF_TOKEN not in _texts(p)
    assert not p.run.disabled


def test_nothing_imports_widgets():
    from tests.test_layers import graph

    assert not [src for src, targets in graph().items() if "diag.widgets" in targets]
