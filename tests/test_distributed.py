"""DDP under the real launcher on CPU (gloo): torchrun on one node, two "nodes" on 127.0.0.1,
a straggler made on purpose, a rank killed mid-run, a rendezvous nobody answers.

Each torchrun spawn imports torch in every process (seconds each on 2 cores): few, small runs.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from diag.timing import stragglers
from diag.timing.spill import read_spills

pytestmark = pytest.mark.slow  # every test starts a launcher's ranks or `python -m diag toy`
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SLOW_MS = 40.0  # rank 1's extra sleep per batch: the delay the others' comm_wait must recover


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DIAG_HOME": str(home),
            "OMP_NUM_THREADS": "1"}


def _toy(*extra: str) -> list[str]:
    return ["-m", "diag", "toy", "--device", "cpu", "--width", "64", "--warmup-steps", "2",
            *extra]


LAUNCHERS = {
    "torchrun": [*TORCHRUN, "--nproc_per_node", "2", "--master_port"],
    # on CPU accelerate's own path is one process (several need MPI); --multi_gpu takes the
    # torchrun path it uses on GPUs, and the ranks pick gloo for a CPU device
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                   "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "--main_process_port"],
}


def _check_straggler(frame: pd.DataFrame) -> pd.Series:
    found = stragglers.findings(frame)
    assert len(found) == 1, found
    row = found.iloc[0]
    assert row["rank"] == 1 and "loader is starved" in row["finding"]
    # the others' comm_wait recovers the injected delay within 20%
    assert row["wait_per_step_s"] == pytest.approx(SLOW_MS / 1000, rel=0.2)
    return row


def test_torchrun_one_node_gathers_both_ranks_and_names_the_straggler(tmp_path):
    out = tmp_path / "toy.csv"
    run = subprocess.run(
        [*TORCHRUN, "--nproc_per_node", "2", "--master_port", str(_port()),
         *_toy("--steps", "12", "--slow-rank", "1", "--slow-ms", str(SLOW_MS), "--csv", str(out))],
        env=_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    frame = pd.read_csv(out)
    assert sorted(frame["rank"].unique()) == [0, 1] and set(frame["node"]) == {0}
    steps = frame[frame["stage"] == "comm_wait"].groupby("rank")["step"].nunique()
    assert steps.tolist() == [12, 12]
    _check_straggler(frame)
    assert run.stdout.count("   warmup") == 2  # one table, printed by rank 0 only
    assert not list((tmp_path / "ranks").glob("*/*"))  # spills go once the frame is gathered


def test_two_nodes_through_the_rendezvous_on_loopback(tmp_path):
    port, out = _port(), tmp_path / "toy.csv"
    procs = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
         "--master_addr", "127.0.0.1", "--master_port", str(port),
         *_toy("--steps", "12", "--slow-rank", "1", "--slow-ms", str(SLOW_MS), "--csv", str(out))],
        env=_env(tmp_path / f"node{node}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for node in (0, 1)]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    frame = pd.read_csv(out)
    assert frame.groupby("rank")["node"].first().to_dict() == {0: 0, 1: 1}
    assert _check_straggler(frame)["node"] == 1


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the worker of this rank among the launcher's children (/proc, Linux)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in map(int, children):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def test_a_rank_killed_mid_run_fails_the_launcher_and_keeps_the_finished_steps(tmp_path):
    out = tmp_path / "toy.csv"
    logs = tmp_path / "logs"  # each rank's own stderr in a file: what diag printed, apart
    launcher = subprocess.Popen(                            # from the launcher's own report
        [*TORCHRUN, "--nproc_per_node", "2", "--master_port", str(_port()),
         "--log-dir", str(logs), "--redirects", "2",
         *_toy("--steps", "5000", "--prep-ms", "5", "--csv", str(out))],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, spilled = time.monotonic() + 120, pd.DataFrame()
        while time.monotonic() < deadline:
            folders = list((tmp_path / "ranks").glob("*"))
            spilled = read_spills(folders[0]) if folders else spilled
            if not spilled.empty and spilled[spilled["rank"] == 1]["step"].max() >= 5:
                break
            time.sleep(0.3)
        assert not spilled.empty, "no rank spilled a step in 120 s"
        victim = _rank_pid(launcher.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    # the surviving rank ends without a traceback of diag's (the launcher prints its own report
    # of the dead rank, interleaved in any order with its log lines: not diag's to control)
    (survivor,) = logs.glob("*/attempt_0/0/stderr.log")
    assert "Traceback" not in survivor.read_text()
    assert not out.exists()  # nothing looks like a complete result
    (folder,) = (tmp_path / "ranks").glob("*")
    assert all(p.name.endswith(".partial.csv") for p in folder.iterdir())
    kept = read_spills(folder)
    for rank in (0, 1):
        mine = kept[kept["rank"] == rank]
        assert mine["step"].max() >= 5
        # every kept step is a finished one: its data_wait, h2d, compute and comm_wait rows
        assert (mine.groupby("step").size() == 4).all()


# under torchrun the optimized plan, measured on the job on both ranks first; under accelerate
# (whose launcher only sets the ranks' environment differently) the naive plan alone
@pytest.mark.parametrize("launcher, plan", [("torchrun", "optimized"), ("accelerate", "naive")])
def test_qlora_runs_as_ddp_and_rank_0_alone_writes_the_run_folder(tmp_path, launcher, plan):
    run = subprocess.run(
        [*LAUNCHERS[launcher], str(_port()), "-m", "diag", "qlora", "--quick", "--device", "cpu",
         "--plan", plan, "--report"],
        cwd=tmp_path, env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    (folder,) = (tmp_path / "runs").iterdir()  # one run folder, from rank 0
    stages = pd.read_csv(folder / "run.csv")  # the stage frame, under its one key
    assert sorted(stages["rank"].unique()) == [0, 1]
    # the Trainer's DDP all-reduce went through diag's hook on both ranks, every timed step
    waits = stages[stages["stage"] == "comm_wait"]
    assert waits.groupby("rank")["step"].nunique().tolist() == [2, 2]  # 3 steps, 1 warm-up
    assert pd.read_csv(folder / "qlora.csv")["ranks"].tolist() == [2]
    page = (folder / "report.html").read_text()
    assert "<h2>Per rank</h2>" in page and (folder / "ranks.png").is_file()
    assert run.stdout.count("wrote ") == 1


def test_a_rank_that_cannot_reach_the_rendezvous_says_so_in_one_line(tmp_path):
    # what a rank started by the environment alone (srun, a scheduler's env) does when the
    # address it dials answers nothing; torchrun's own agent waits for its rendezvous before
    # starting any rank, and its error is then the launcher's alone (docs/distributed.md)
    port = _port()
    env = {**_env(tmp_path), "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "DIAG_RENDEZVOUS_TIMEOUT_S": "3"}
    run = subprocess.run([sys.executable, *_toy("--steps", "2")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert lines[0].startswith(f"diag: RendezvousError: rank 1 (node 1) could not reach the "
                               f"rendezvous at 127.0.0.1:{port} over gloo")


def test_a_world_the_sweep_cannot_split_exits_2_on_every_rank_with_one_line(tmp_path):
    # every rank refuses the config within a second of its start: the launcher looks every 2 s
    # (0.1 s by default), so it finds them done rather than stopping rank 0 before its line
    run = subprocess.run(
        [*TORCHRUN, "--nproc_per_node", "3", "--master_port", str(_port()), "--monitor-interval",
         "2", "-m", "diag", "accum", "--quick", "--device", "cpu", "--micro-batches", "2,4"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert run.returncode != 0
    # every rank exits 2; the launcher reports those that ended before it stopped the others
    # (a rank it had to terminate first shows as -15, or as 143 once diag's SIGTERM handler is
    # in: 128 + 15; which ones is a race)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", run.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15", "143"}, codes
    ours = [line for line in run.stderr.splitlines() if line.startswith("diag: ")]
    assert ours == ["diag: ValueError: AccumConfig.tokens_per_step=1024 (16 sequences of 64) is "
                    "not divisible by world size 3 x micro-batch 2 = 6; micro-batches that "
                    "divide it at this world size: none (make AccumConfig.tokens_per_step a "
                    "multiple of 192)"]
