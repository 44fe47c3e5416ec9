"""Shared test set-up: every test runs quick and writes only under a temporary DIAG_HOME."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE_HF_TOKEN = "hf_diagTestFakeToken0123456789"


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
