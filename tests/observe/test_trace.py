"""`diag trace` on real torch.profiler traces of diag's toy loop (one process, and two DDP ranks
with a straggler), against the toy's own StageTimer figures; the bad inputs' one lines; the run
folder; the GPU figures against HTA's temporal breakdown on a GPU-shaped trace."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from diag import amdahl
from diag.cli import main
from diag.observe import trace

HERE = Path(__file__).parent
STEP = ["data_wait", "h2d", "compute", "comm_wait", "other"]
pytestmark = pytest.mark.xdist_group("observe_trace")


def step_shares(frame: pd.DataFrame) -> pd.Series:
    seconds = amdahl.shares(frame).set_index("stage")["seconds"]
    seconds = seconds[seconds.index.isin(STEP)]
    return seconds / seconds.sum()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The toy loop (15 ms asleep per batch in the loop) under torch.profiler on CPU: (its
    trace, its own StageTimer frame)."""
    out = tmp_path_factory.mktemp("single")
    cfg = {"steps": 80, "warmup_steps": 1, "prep_ms": 15, "device": "cpu", "width": 512,
           "batch_size": 64}
    subprocess.run([sys.executable, str(HERE / "known_job.py"), str(out / "truth.csv"),
                    json.dumps(cfg), str(out / "trace.json")], check=True, timeout=300,
                   stdout=subprocess.DEVNULL)
    frame = pd.read_csv(out / "truth.csv")
    frame.attrs["waited"] = float((out / "truth.csv.waited").read_text())
    return out / "trace.json", frame


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """Two gloo DDP ranks of the toy loop under torchrun, rank 1's loader 30 ms slower a batch:
    (their traces, the ranks' own gathered frame)."""
    out = tmp_path_factory.mktemp("ddp")
    cfg = {"steps": 16, "warmup_steps": 1, "prep_ms": 5, "device": "cpu", "slow_rank": 1,
           "slow_ms": 30}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    str(HERE / "known_job.py"), str(out / "truth.csv"), json.dumps(cfg),
                    str(out / "rank-N.json")], check=True, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [out / "rank-0.json", out / "rank-1.json"], pd.read_csv(out / "truth.csv")


@pytest.mark.slow
def test_trace_recovers_the_toys_own_shares(single, tmp_path):
    path, own = single
    got = trace(path)
    shares, truth = step_shares(got.stages), step_shares(own)
    # 5 points, plus the share of the run the toy's thread waited for a CPU: on a busy box a
    # preemption inside a step lands in the trace's gaps or in the timer's stage
    for stage in ("data_wait", "compute"):
        assert abs(shares[stage] - truth[stage]) <= 0.05 + own.attrs["waited"], (
            stage, shares.round(3).to_dict(), truth.round(3).to_dict(), own.attrs["waited"])
    assert got.verdict["verdict"].iloc[0] == amdahl.verdict(amdahl.shares(own))["verdict"]
    # the same trace gzipped (as tensorboard_trace_handler writes it) reads the same
    packed = tmp_path / "trace.json.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    pd.testing.assert_frame_equal(trace(packed).stages, got.stages)


@pytest.mark.slow
def test_ranks_and_the_straggler(ddp):
    paths, own = ddp
    got = trace(*paths)
    assert got.stragglers is not None and got.stragglers["ranks"].tolist() == ["1"], got.ranks
    assert "loader is starved" in got.stragglers["finding"].iloc[0]
    for rank in (0, 1):
        shares = step_shares(got.stages[got.stages["rank"] == rank])
        truth = step_shares(own[own["rank"] == rank])
        assert abs(shares["data_wait"] - truth["data_wait"]) <= 0.05, (rank, shares, truth)
        # the split of a rank's own work from its wait on the others is timed differently
        # (docs/attach.md); their sum is compared
        work = ["compute", "comm_wait"]
        assert abs(shares[work].sum() - truth[work].sum()) <= 0.05, (rank, shares, truth)


@pytest.mark.slow
def test_bad_traces_get_one_line(single, ddp, tmp_path, capsys):
    path, _ = single
    not_kineto = tmp_path / "chrome.json"
    not_kineto.write_text(json.dumps([{"ph": "B", "name": "main", "ts": 0}]))  # py-spy's kind
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(path.read_bytes())[:5000])
    for files, said in [([not_kineto], "not a torch.profiler (Kineto) trace"),
                        ([cut], "a truncated or damaged .json.gz"),
                        ([path, ddp[0][0]], "traces of different runs"),
                        ([path, path], "a trace given twice"),
                        ([tmp_path / "missing.json"], "is not a file")]:
        assert main(["trace", *map(str, files)]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_report_shows_the_trace(single, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["trace", str(single[0]), "--report"]) == 0
    said = trace(single[0]).verdict["text"].iloc[0]
    assert said in capsys.readouterr().out
    page = next(tmp_path.glob("runs/*/report.html")).read_text()
    assert "A torch.profiler trace: where each rank" in page and said in page


def gpu_trace(path: Path, rank: int, steps: int = 6) -> None:
    """A Kineto trace of the shape a CUDA run writes: per ProfilerStep a host-to-device copy,
    a GEMM, an elementwise kernel and an NCCL all-reduce on another stream, launched by the
    host with correlation ids; between them the GPU idles."""
    events, corr = [], 1
    for i in range(steps):
        t = 1000.0 + i * 10_000.0  # microseconds
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}",
                       "pid": 1000, "tid": 1000, "ts": t, "dur": 9000.0, "args": {}})
        for launch, cat, name, start, dur, stream in [
                (100, "gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 300, 500, 7),
                (800, "kernel", "ampere_sgemm_128x64_nn", 1400, 4000, 7),
                (900, "kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1100,
                 2000 + 300 * (i % 2), 20),
                (950, "kernel", "elementwise_kernel", 5550, 700, 7)]:
            runtime = "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel"
            events += [{"ph": "X", "cat": "cuda_runtime", "name": runtime, "pid": 1000,
                        "tid": 1000, "ts": t + launch, "dur": 30.0,
                        "args": {"correlation": corr}},
                       {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                        "ts": t + start, "dur": float(dur),
                        "args": {"device": 0, "stream": stream, "correlation": corr}}]
            corr += 1
    path.write_bytes(gzip.compress(json.dumps({
        "schemaVersion": 1, "traceEvents": events,
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
        "baseTimeNanoseconds": 1_700_000_000_000_000_000}).encode()))


@pytest.mark.slow  # HTA parses each rank in a process of its own
@pytest.mark.filterwarnings("ignore:The inplace keyword")  # HTA's own use of pandas
def test_gpu_time_matches_hta(tmp_path):
    pytest.importorskip("hta", reason="HolisticTraceAnalysis is not installed (the dev extra)")
    from hta.trace_analysis import TraceAnalysis

    for rank in (0, 1):
        gpu_trace(tmp_path / f"rank-{rank}.json.gz", rank)
    ours = trace(*sorted(tmp_path.glob("rank-*.json.gz"))).gpu.set_index("rank")
    cwd = os.getcwd()
    try:  # HTA writes its parsing logs beside the traces
        hta = TraceAnalysis(trace_dir=str(tmp_path), include_last_profiler_step=True)
        theirs = hta.get_temporal_breakdown(visualize=False).set_index("rank")
    finally:
        os.chdir(cwd)
    for rank in (0, 1):
        assert ours.loc[rank, "idle_s"] * 1e6 == pytest.approx(
            theirs.loc[rank, "idle_time(us)"], rel=1e-6)
        assert ours.loc[rank, "compute_s"] * 1e6 == pytest.approx(
            theirs.loc[rank, "compute_time(us)"], rel=1e-6)
        assert ours.loc[rank, "span_s"] * 1e6 == pytest.approx(
            theirs.loc[rank, "kernel_time(us)"], rel=1e-6)
    # the host-to-device copies are h2d in the stage table
    assert (trace(tmp_path / "rank-0.json.gz").stages["stage"] == "h2d").any()
