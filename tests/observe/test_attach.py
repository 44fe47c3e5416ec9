"""`diag attach` on real processes: diag's toy loop (a DataLoader worker busy in a known
function) and a nanoGPT-shaped plain loop, each timing itself; the shares py-spy recovers
against theirs, the workers' hot function, and the one-line failures. py-spy needs ptrace,
which root has here; without it these tests skip, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from diag import amdahl
from diag.cli import main
from diag.observe import attach

HERE = Path(__file__).parent
STEP = ["data_wait", "h2d", "compute", "comm_wait", "other"]
pytestmark = [pytest.mark.xdist_group("observe_attach"), pytest.mark.skipif(
    os.geteuid() != 0, reason="py-spy needs ptrace of another process: these tests run as root")]


def started(*args: str) -> subprocess.Popen:
    """A job script of this folder, once it says it is ready (torch imported)."""
    job = subprocess.Popen([sys.executable, str(HERE / args[0]), *args[1:]],
                           stdout=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "ready"
    return job


def step_shares(seconds: pd.Series, leave_out: tuple[str, ...] = ()) -> pd.Series:
    part = seconds[seconds.index.isin(STEP) & ~seconds.index.isin(leave_out)]
    return part / part.sum()


def close(got: pd.DataFrame, shares: pd.Series, truth: pd.Series, stage: str,
          waited: float) -> bool:
    """Within 5 points, or the attach's own 95% interval where that is wider, plus the share of
    the job's wall its thread waited for a CPU (a busy box's preemption lands in either stage)."""
    row = got.set_index("stage").loc[stage]
    tolerance = max(0.05, (row["high"] - row["low"]) / 2) + waited
    return abs(shares[stage] - truth[stage]) <= tolerance


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """diag's toy loop, one worker spinning 12 ms per batch in busy_prep, attached until it
    exits: (the attach, the toy's own StageTimer frame)."""
    truth = tmp_path_factory.mktemp("toy") / "truth.csv"
    cfg = {"steps": 180, "warmup_steps": 1, "prep_ms": 12, "prep": "busy", "num_workers": 1,
           "device": "cpu", "width": 256, "batch_size": 64}
    job = started("known_job.py", str(truth), json.dumps(cfg))
    got = attach(job.pid, seconds=120, rate=250, progress=False)
    assert job.wait(timeout=60) == 0
    frame = pd.read_csv(truth)
    frame.attrs["waited"] = float(Path(f"{truth}.waited").read_text())
    return got, frame


@pytest.mark.slow
def test_attach_recovers_the_toys_own_shares(toy):
    got, own_frame = toy
    own = amdahl.shares(own_frame).set_index("stage")["seconds"]
    # other: the attach window also holds the run's edges (the worker's start and shutdown),
    # which the toy's train stage leaves out; the split of the step is what is compared
    shares = step_shares(got.attach.set_index("stage")["seconds"], ("other",))
    truth = step_shares(own, ("other",))
    for stage in ("data_wait", "compute"):
        assert close(got.attach, shares, truth, stage, own_frame.attrs["waited"]), (
            stage, shares.round(3).to_dict(), truth.round(3).to_dict())
    assert got.verdict["verdict"].iloc[0] == amdahl.verdict(amdahl.shares(own_frame))["verdict"]
    assert (got.stages.columns.tolist() == ["stage", "seconds", "step", "rank", "node", "run"])


@pytest.mark.slow
def test_the_workers_hot_function_is_the_injected_one(toy):
    got, _ = toy
    assert got.workers is not None, "no DataLoader worker was sampled"
    busy = got.workers[got.workers["file"] != ""]  # making a batch, not waiting for work
    assert busy.iloc[0]["function"] == "busy_prep", got.workers.head()
    assert busy.iloc[0]["file"].endswith("diag/loader/toy.py")


@pytest.mark.slow
def test_a_process_that_exits_mid_sample_keeps_what_was_sampled(toy):
    got, _ = toy
    note = got.verdict["note"].iloc[0]
    assert "exited" in note and "asked for" in note
    assert got.attach["seconds"].sum() > 2  # the sampled seconds are kept, not dropped


@pytest.fixture(scope="module")
def nanogpt(tmp_path_factory):
    """A plain nanoGPT-shaped loop pausing 20 ms a step in time.sleep, attached to exit."""
    truth = tmp_path_factory.mktemp("nanogpt") / "truth.json"
    job = started("nanogpt_loop.py", str(truth), "3")
    got = attach(job.pid, seconds=120, rate=250, progress=False)
    assert job.wait(timeout=60) == 0
    return got, pd.Series(json.loads(truth.read_text()))


@pytest.mark.slow
def test_a_plain_loop_is_classified(nanogpt):
    got, own = nanogpt
    seconds = got.attach.set_index("stage")["seconds"]
    shares, truth = step_shares(seconds), step_shares(own)
    # its sleep outside every stage is other, not compute; get_batch is data_wait
    for stage in ("compute", "other", "data_wait"):
        assert close(got.attach, shares, truth, stage, own["waited"]), (
            stage, shares.round(3).to_dict(), truth.round(3).to_dict(), own["waited"])
    # no data delay: not called input-bound
    assert got.verdict["verdict"].iloc[0] != "input-bound"


def test_failures_are_one_line(capsys, tmp_path):
    """Each refusal is one line on stderr, exit 2, before any sampling."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        for argv, said in [(["attach", "0"], "AttachConfig.pid=0"),
                           (["attach", "1", "--seconds", "0"], "AttachConfig.seconds=0.0"),
                           (["attach", str(pid_max)], "no such process"),
                           (["attach", str(sleeper.pid), "--seconds", "1"],
                            "not a Python process")]:
            assert main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert said in err and len(err.splitlines()) == 1, err
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv to drop root with")
def test_ptrace_refused_says_the_fix():
    """As nobody, ptrace of a root process is refused: one line naming sudo, CAP_SYS_PTRACE
    and ptrace_scope."""
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
    env = {**os.environ, "HOME": "/tmp"}
    if subprocess.run([*nobody, "-c", "import diag"], capture_output=True, env=env).returncode:
        pytest.skip("uid 65534 cannot read this checkout or its venv (a mode-700 folder above it)")
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        done = subprocess.run([*nobody, "-m", "diag", "attach", str(target.pid), "--seconds", "1"],
                              capture_output=True, text=True, timeout=60, env=env)
    finally:
        target.kill()
        target.wait()
    line = done.stderr.strip()
    assert done.returncode == 2 and len(line.splitlines()) == 1, done.stderr
    assert "refused" in line and "CAP_SYS_PTRACE" in line and "ptrace_scope" in line
