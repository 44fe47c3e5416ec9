"""`python -m diag run` (what `make demo` runs), end to end on the embedded defaults, quick."""

import json
import statistics
import subprocess
import sys

import pytest

from diag import report
from tests.conftest import FAKE_HF_TOKEN


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    done = subprocess.run([sys.executable, "-m", "diag", "run", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


@pytest.mark.slow
def test_demo_writes_every_experiment_and_prints_path_and_top_finding(demo):
    out, done = demo
    lines = done.stdout.strip().splitlines()
    assert lines[0] == f"wrote {out / 'report.html'}"
    assert lines[1].startswith("top finding: ")
    names = {p.name for p in out.iterdir()}
    assert {"run.csv", "info.csv", "storage.csv", "storage_tax.csv", "model_load.csv",
            "advice.csv", "summary.json", "report.html", "stage_shares.png", "amdahl.png",
            "waterfall.png", "storage.png", "model_load.png", "accum.csv", "accum_summary.csv",
            "accum_mfu.csv", "accum.png", "loader.csv", "loader_stalls.csv",
            "loader_lines.csv", "loader_recommendation.csv", "loader.png"} <= names
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 7


@pytest.mark.slow
def test_runs_carry_the_measured_fetch_and_load(demo):
    out, _ = demo
    frames = report.load(out)
    storage, models, run = frames["storage"], frames["model_load"], frames["run"]
    fetch = run[run["stage"] == "fetch_data"].set_index("run")["seconds"]
    naive_pull = statistics.median(storage.query("method == 'boto3_default'")["seconds"])
    hit = statistics.median(storage.query("method == 'land' and cache_state == 'hit'")["seconds"])
    assert fetch["naive"] == pytest.approx(naive_pull)
    assert fetch["optimized"] == pytest.approx(hit)
    load = run[run["stage"] == "load_model"].set_index("run")["seconds"]
    fresh = statistics.median(models.query("scenario == 'fresh' and part == 'load_model'")["seconds"])
    assert load["naive"] == pytest.approx(fresh)
    summary = json.loads((out / "summary.json").read_text())
    stages = {(s["run"], s["stage"]) for s in summary["stages"]}
    assert {("naive", "fetch_data"), ("naive", "load_model"), ("optimized", "compute")} <= stages
    assert summary["findings"] and summary["top_finding"]
    assert summary["device"]["cpu_model"] and "peak_tflops_bf16" in summary["device"]


@pytest.mark.slow
def test_demo_leaks_no_secret(demo):
    out, done = demo
    assert FAKE_HF_TOKEN not in done.stdout + done.stderr
    for path in out.iterdir():
        assert FAKE_HF_TOKEN.encode() not in path.read_bytes(), path.name
