"""Every notebook runs end to end with a real kernel, in quick mode, within a time limit.

Committed notebooks are thin: outputs stripped, a first code cell tagged `parameters` holding
literals only, and no `def` or loop (those belong in diag/).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from diag.runner import VIEW
from tests.browser import chromium
from tests.conftest import FAKE_HF_TOKEN, QUICK_RUN

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIME_LIMIT_S = 300  # per notebook, quick mode


def _code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert any(p.name == "00_tour.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_thin(path: Path):
    cells = _code_cells(path)
    assert cells, "no code cells"
    assert "parameters" in cells[0].get("metadata", {}).get("tags", []), \
        "first code cell must be tagged parameters"
    params = ast.parse("".join(cells[0]["source"]))
    for node in params.body:
        assert isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant), (
            f"parameters cell holds literals only, found: {ast.unparse(node)}")
    for cell in cells:
        assert not cell.get("outputs") and cell.get("execution_count") is None, "strip outputs"
        tree = ast.parse("".join(cell["source"]))
        for node in ast.walk(tree):
            assert not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                         ast.For, ast.While, ast.Lambda, ast.comprehension)), (
                f"notebook code belongs in diag/: {ast.unparse(node)[:60]}")


# the tour reads the shared quick run's folder (its `results` parameter) instead of measuring
# the whole diagnosis again in its kernel; the browser test's panel Run measures in a kernel.
# The train notebook takes its plan and costs from that folder too (as `diag train --results`),
# and the stage-shares notebook the QLoRA job's runs
TOUR = "00_tour.ipynb"
FROM_QUICK_RUN = {TOUR, "05_stage_shares.ipynb", "07_train.ipynb"}
# Run in JupyterLab by tests/test_browser.py (every cell in a real kernel, then the same checks:
# no error output, no secret in the saved notebook): papermill runs them only where those tests
# cannot run, so that no notebook goes untested
IN_BROWSER = {TOUR, "03_num_workers.ipynb"}
BROWSER_SKIP = pytest.mark.skip(reason="run in JupyterLab in chromium by tests/test_browser.py")


# diag's calls in these leave no warning and nothing else on stderr (diag.runner.quiet)
QUIET = {TOUR, "01_storage.ipynb", "02_model_load.ipynb", "03_num_workers.ipynb",
         "04_grad_accum.ipynb", "05_stage_shares.ipynb", "06_qlora.ipynb", "07_train.ipynb"}


def untidy(path: Path, quiet: bool = True) -> list[str]:
    """What a person should not see in a saved notebook: a repr as a cell's result (text only,
    e.g. `<Axes: ...>`, `PosixPath(...)`), a widget left behind by a progress bar (a reload or a
    later reader sees "model not found"; the panel itself is the one widget), and with quiet
    anything on stderr (warnings, the plan, diag's lines)."""
    out = []
    for cell in json.loads(path.read_text())["cells"]:
        for o in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            data, head = o.get("data", {}), "".join(cell["source"])[:60]
            if o["output_type"] == "execute_result" and set(data) == {"text/plain"}:
                out.append(f"a repr: {head!r} -> {''.join(data['text/plain'])[:80]!r}")
            if VIEW in data and "diag-no-widgets" not in "".join(data.get("text/html", "")):
                out.append(f"a widget left behind: {head!r}")
            if quiet and o.get("name") == "stderr":
                out.append(f"stderr: {head!r} -> {''.join(o['text'])[:200]!r}")
    return out


def _marks(path: Path) -> list[pytest.MarkDecorator]:
    if path.name in IN_BROWSER and chromium()[0] is not None:
        return [BROWSER_SKIP]
    return [pytest.mark.xdist_group(QUICK_RUN)] if path.name in FROM_QUICK_RUN else []


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p)) for p in NOTEBOOKS],
                         ids=lambda p: p.name)
def test_notebook_executes(path: Path, tmp_path: Path, request):
    import papermill

    out = tmp_path / path.name
    parameters = {"quick": True}
    if path.name in FROM_QUICK_RUN:
        parameters["results"] = str(request.getfixturevalue("quick_run")[0])
    papermill.execute_notebook(
        str(path), str(out), parameters=parameters, kernel_name="python3",
        cwd=str(tmp_path), execution_timeout=TIME_LIMIT_S, progress_bar=False,
        # the kernel inherits DIAG_QUICK=1 and the isolated DIAG_HOME from conftest; its cwd is
        # the test's folder, so a run folder it writes (runs/<UTC>) never lands in the checkout
    )
    executed = json.loads(out.read_text())
    errors = [o for c in executed["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert not untidy(out, quiet=path.name in QUIET), untidy(out, quiet=path.name in QUIET)
    text = out.read_text()
    assert os.environ["HF_TOKEN"] == FAKE_HF_TOKEN  # set by conftest for every test
    assert FAKE_HF_TOKEN not in text
