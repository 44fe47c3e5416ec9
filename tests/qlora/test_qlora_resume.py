"""Checkpoint and resume: a QLoRA run killed with SIGKILL mid-run resumes from its last complete
checkpoint (adapter, optimizer, scheduler, data position) and finishes with the same steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.slow  # `python -m diag qlora` processes, one killed mid-run
STEPS = 6


def _command(out: Path, *extra: str) -> list[str]:
    # the naive plan: its settings are fixed, so the resumed run is the same run (the optimized
    # plan is measured on the job at each start, and may decide differently the second time)
    return [sys.executable, "-m", "diag", "qlora", "--quick", "--plan", "naive", "--rounds", "1",
            "--records", "12", "--steps", str(STEPS), "--checkpoint-every", "1",
            "--out-dir", str(out), *extra]


def _env(tmp: Path) -> dict[str, str]:
    # TMPDIR inside the test's folder: a SIGKILLed run cannot remove its work folder, and the
    # test must leave nothing behind outside tmp_path
    (tmp / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp / "tmp"), "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def test_sigkill_mid_run_then_resume_finishes_the_same_steps(tmp_path):
    from diag.qlora.checkpoints import last_checkpoint

    out = tmp_path / "out"
    proc = subprocess.Popen(_command(out), env=_env(tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while last_checkpoint(out / "naive") is None or \
                int(last_checkpoint(out / "naive").name.split("-")[1]) < 2:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    killed_at = int(last_checkpoint(out / "naive").name.split("-")[1])
    assert 2 <= killed_at < STEPS
    done = subprocess.run(_command(out, "--resume", "--json"), env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    row = result["qlora"][0]
    assert row["steps"] == STEPS
    assert row["resumed_from_step"] >= killed_at
    # the resumed run trained only the missing steps; its loss log still holds every step
    losses = [r["step"] for r in result["qlora_losses"]]
    assert losses == list(range(1, STEPS + 1))
    steady = {r["step"] for r in result["run"] if r["step"] is not None}  # the stage frame
    assert min(steady) >= row["resumed_from_step"]
    # the command prints the plan's MFU by both FLOP counts, each named (CPU too)
    assert [r["flops"].split(" (")[0] for r in result["qlora_mfu"]] == [
        "executed", "model FLOPs 8N + 16·L·d·T"]  # the naive plan checkpoints
    state = json.loads((last_checkpoint(out / "naive") / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS
