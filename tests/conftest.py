"""Shared test set-up: every test runs quick and writes only under a temporary DIAG_HOME."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE_HF_TOKEN = "hf_diagTestFakeToken0123456789"


# Tools the tests drive keep caches in the home folder (huggingface_hub's cache, matplotlib's font
# cache, IPython's profile, Jupyter's runtime files): each test process points them into one
# temporary folder of its own, set before any test module imports them (transformers reads
# HF_HOME at import), and removed when the process ends. A user's ~/.cache is never touched.
_TOOL_HOMES = {"HF_HOME": "hf", "MPLCONFIGDIR": "mpl", "IPYTHONDIR": "ipython",
               "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config", "XDG_DATA_HOME": "data",
               "JUPYTER_RUNTIME_DIR": "jupyter-runtime"}
_tool_root: str | None = None
_tool_old: dict[str, str | None] = {}


def pytest_configure(config: pytest.Config) -> None:
    global _tool_root
    _tool_root = tempfile.mkdtemp(prefix="diag-test-tools-")
    for key, sub in _TOOL_HOMES.items():
        _tool_old[key] = os.environ.get(key)
        os.environ[key] = os.path.join(_tool_root, sub)
        os.makedirs(os.environ[key], exist_ok=True)
    # Two xdist workers on two cores: each process's OpenMP pool gets one thread (inherited by
    # the kernels, CLIs and launchers the tests start), or every tiny op waits at a barrier for
    # a thread the other worker has descheduled (diag.machine.device.cpu_threads measures why)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        _tool_old[key] = os.environ.get(key)
        os.environ[key] = "1"
    # the token files of the user's real HF home must not leak into a test either
    _tool_old.setdefault("HF_HUB_CACHE", os.environ.pop("HF_HUB_CACHE", None))
    _tool_old.setdefault("HUGGINGFACE_HUB_CACHE", os.environ.pop("HUGGINGFACE_HUB_CACHE", None))


def pytest_unconfigure(config: pytest.Config) -> None:
    for key, value in _tool_old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if _tool_root:
        shutil.rmtree(_tool_root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory):
    # Session-wide so the embedded assets are made once; never the user's ~/.cache/diag.
    home = os.environ.get("DIAG_TEST_HOME") or str(tmp_path_factory.mktemp("diag_home"))
    old = {k: os.environ.get(k) for k in ("DIAG_HOME", "DIAG_QUICK", "MPLBACKEND", "HF_TOKEN")}
    # A fake token is always set, so every notebook and report test also checks it never leaks.
    os.environ.update(DIAG_HOME=home, DIAG_QUICK="1", MPLBACKEND="Agg", HF_TOKEN=FAKE_HF_TOKEN)
    yield Path(home)
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# One `diag run --quick` (what `make demo` runs, test-sized) shared by the tests that read a
# whole run folder: test_diagnose and the tour notebook. They share the xdist group QUICK_RUN
# (make test runs `--dist loadgroup`), so one worker makes it once; a test run by itself makes
# its own. The notebook that measures in its kernel is the browser test's panel Run.
QUICK_RUN = "quick_run"


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory: pytest.TempPathFactory, _isolated_home):
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("demo") / "run"
    done = subprocess.run([sys.executable, "-m", "diag", "run", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done
