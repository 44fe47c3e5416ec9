"""`diag run --budget` (issue 32 item 1): the plan printed before the first step, the budget
split among the steps and kept by the ones that size their work to it, estimated vs spent in
the run folder; bad budgets refused in one line before any work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pandas as pd
import pytest

from diag.forecast.budget import FLOORS, Budget
from diag.cli import main
from diag.config import DiagnoseConfig
from diag.diagnose import steps
from diag.runner import Step


def _refused(capsys, monkeypatch, *argv: str) -> str:
    # any experiment starting would be work: each one raises here
    import diag.diagnose as diagnose

    monkeypatch.setattr(diagnose, "run_info", lambda *a, **k: pytest.fail("work started"))
    monkeypatch.setattr("diag.preflight.preflight", lambda *a, **k: pytest.fail("preflight ran"))
    assert main(["run", "--quick", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_bad_budgets_are_refused_in_one_line_before_any_work(capsys, monkeypatch):
    assert "budget='0': must be more than 0" in _refused(capsys, monkeypatch, "--budget", "0")
    for bad in ("15 minutes", "m15", "1.5.2m", "-5m"):
        err = _refused(capsys, monkeypatch, f"--budget={bad}")
        assert f"budget={bad!r}: a duration such as 15m, 90s, 1h30m" in err


def test_a_budget_too_small_names_the_minimum_of_the_steps_enabled(capsys, monkeypatch):
    every = sum(FLOORS[s.field] for s in steps(DiagnoseConfig.quick()))
    err = _refused(capsys, monkeypatch, "--budget", "10s")
    assert f"too small for the steps enabled: at least {every:.0f} s" in err
    assert f"model load {FLOORS['model_load']:.0f} s" in err
    # fewer steps need less
    err = _refused(capsys, monkeypatch, "--budget", "10s", "--no-model-load")
    assert f"at least {every - FLOORS['model_load']:.0f} s" in err


def test_a_step_that_overran_takes_from_the_later_steps_never_from_the_total():
    parts = [Step("storage", "storage"), Step("model load", "model_load"),
             Step("naive vs optimized QLoRA", "qlora")]
    budget = Budget(300.0, parts, "5m")
    planned = {s.field: budget.estimate(s) for s in parts}
    assert sum(planned.values()) == pytest.approx(300.0)
    assert all(planned[s.field] >= FLOORS[s.field] for s in parts)
    # storage was given its share and took 100 s more than that
    budget.given["storage"] = planned["storage"]
    budget.spent["storage"] = planned["storage"] + 100
    budget.started = time.perf_counter() - budget.spent["storage"]
    later = {f: budget.share(s) for s, f in ((p, p.field) for p in parts[1:])}
    assert sum(later.values()) == pytest.approx(300.0 - budget.spent["storage"], rel=1e-3)
    assert later["model_load"] < planned["model_load"] and later["qlora"] < planned["qlora"]
    assert budget.share(parts[0]) == planned["storage"]  # a started step's share stays put


@pytest.fixture(scope="module")
def shards():
    from diag.embedded import S3Server

    with S3Server() as server:  # "a few MB" in many small objects: a pull pays per object
        client = server.client()
        for i in range(200):
            client.put_object(Bucket="diag", Key=f"few/part-{i:03d}.bin", Body=os.urandom(40_000))
        yield server


@pytest.mark.slow  # a `python -m diag run` that imports torch (the toy loop)
def test_the_plan_comes_first_and_storage_keeps_its_share(shards, tmp_path):
    flags = ["--quick", "--no-model-load", "--no-accum", "--no-loader", "--no-qlora"]
    cfg = DiagnoseConfig.quick(storage=True, model_load=False, accum=False, loader=False,
                               qlora=False)
    least = sum(FLOORS[s.field] for s in steps(cfg))  # the smallest budget it takes
    out = tmp_path / "run"
    env = {**os.environ, **shards.env()}
    done = subprocess.run(
        [sys.executable, "-m", "diag", "run", *flags, "--budget", f"{least:g}s",
         "--source", "s3://diag/few/", "--endpoint-url", shards.endpoint_url, "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    # on stderr beside the progress bar (stdout: the result lines), the plan before the bar
    err = done.stderr
    head = f"diag run: budget {least:g}s, the plan (estimated, what it measures):\n"
    assert head in err and err.index(head) < re.search(r"diag run: +0%", err).start()
    plan = err[err.index(head) + len(head):].splitlines()[:len(steps(cfg))]
    assert [s.name for s in steps(cfg)] == [p.strip().split("  ")[0] for p in plan]
    assert "a sample sized to this share" in plan[1]
    after = err.index(f"diag run: budget {least:g}s, estimated vs spent:")
    assert after > re.search(r"diag run: +100%", err).start()
    assert done.stdout.splitlines()[0] == f"wrote {out / 'report.html'}"
    spent = pd.read_csv(out / "budget.csv").set_index("step")
    assert spent.loc["the whole diagnosis", "estimated_s"] == pytest.approx(least)
    # storage sized its pulls to its share: a sample, not the 200 objects, pulled in it
    pulls = pd.read_csv(out / "storage.csv")
    pulls = pulls[pulls["method"].isin(["boto3_default", "boto3_tuned", "s5cmd"])]
    assert (pulls["files"] < 200).all() and (pulls["dataset_files"] == 200).all()
    assert pulls["seconds"].sum() <= spent.loc["storage", "share_s"]


def test_floors_scale_with_the_model_and_source_sizes_known_before_the_start():
    from diag.forecast.budget import (HUB_BYTES_PER_S, LOAD_BYTES_PER_S, PULL_BYTES_PER_S,
                                      Sizes, clock, floors)

    cfg = DiagnoseConfig.quick()
    tiny = floors(Sizes(), cfg)  # the embedded model and data: the floors as measured
    assert {k: v[0] for k, v in tiny.items()} == FLOORS and not any(v[1] for v in tiny.values())
    # a 7B model the cache lacks (13.5 GB listed) and a 25 GB one-object source (256 MB ranges)
    big = floors(Sizes(13_500_000_000, "hub", 25 * 10**9, 256 * 10**6, "a 7B"), cfg)
    load, store = cfg.model_load_config(), cfg.storage_config()
    loads = load.warmup + load.repeats * len(load.scenarios)  # the cache filled, then fresh
    assert big["model_load"][0] == pytest.approx(
        FLOORS["model_load"] + 13.5e9 * (loads / LOAD_BYTES_PER_S + 2 / HUB_BYTES_PER_S))
    assert big["model_load"][1] == f"20 s + {loads} loads of 13.5 GB + 2 downloads of 13.5 GB"
    pulls = 1 + (store.warmup + store.repeats) * 4  # the probe; 3 methods and a read per round
    assert big["storage"][0] == pytest.approx(FLOORS["storage"] + pulls * 256e6 / PULL_BYTES_PER_S)
    for step in ("accum", "checkpointing", "qlora"):  # each loads the model
        assert big[step][0] >= FLOORS[step] + 13.5
    assert big["loader"][0] == FLOORS["loader"]  # on the step the decisions before it loaded
    # a cached model is not downloaded; its fresh load is estimated from one file
    cached = floors(Sizes(13_500_000_000, "cached"), cfg)
    assert cached["model_load"] == (FLOORS["model_load"] + 13.5 * loads,
                                    f"20 s + {loads} loads of 13.5 GB")
    # the plan printed before the first step says what its floors rest on, and its estimates
    # sit above them
    parts = [s for s in steps(cfg) if s.field != "train"]
    plan = Budget(3600.0, parts, "1h", floors=big, sizes="the model's 13.5 GB (hub)")
    table = plan.plan().set_index("step")
    assert table.loc["model load", "floor_s"] == pytest.approx(big["model_load"][0])
    assert (table["estimated_s"] >= table["floor_s"]).all()
    shown = plan.show()
    assert "floors scaled from the model's 13.5 GB (hub) at assumed rates: the hub" in shown
    assert f"(floor {clock(big['model_load'][0])}: {big['model_load'][1]})" in shown


def test_a_budget_too_small_for_a_large_model_names_its_scaled_minimum(capsys, monkeypatch,
                                                                       tmp_path):
    from diag.forecast.budget import Sizes, clock, floors

    # a local model folder of 14 GB of weights (a sparse file: nothing written, nothing read)
    (tmp_path / "config.json").write_text("{}")
    with open(tmp_path / "model.safetensors", "wb") as weights:
        weights.truncate(14 * 10**9)
    err = _refused(capsys, monkeypatch, "--budget", "2m", "--model", str(tmp_path))
    cfg = DiagnoseConfig.quick(model=str(tmp_path))
    scaled = floors(Sizes(14 * 10**9, "local"), cfg)
    need = sum(scaled[s.field][0] for s in steps(cfg) if s.field != "train")
    assert need > sum(FLOORS[s.field] for s in steps(cfg)) + 14 * 3  # 3+ loads of 14 GB
    assert f"too small for the steps enabled: at least {clock(need)} (" in err
    assert f"model load {clock(scaled['model_load'][0])}" in err
    assert "floors scaled from the model's 14 GB (local) at assumed rates" in err


def test_a_hub_models_listed_size_scales_the_floors_without_a_download(capsys, monkeypatch,
                                                                       tmp_path):
    import json

    from diag.forecast.budget import Sizes, clock, floors
    from diag.embedded import HubServer

    # a hub whose listing says 13.5 GB of weights (a stored manifest: no such bytes anywhere)
    commit = "ab" * 20
    repo = tmp_path / "hub" / "big-org" / "llama-7b"
    (repo / "commits" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    entry = {"sha256": "0" * 64, "lfs": True, "blob_id": "1" * 40, "pointer_size": 134}
    (repo / "commits" / commit / ".diag-manifest.json").write_text(json.dumps({
        "repo_id": "big-org/llama-7b", "commit": commit, "last_modified": "2026-01-01T00:00:00Z",
        "files": {f"model-0000{i}-of-00002.safetensors": {**entry, "size": 6_750_000_000}
                  for i in (1, 2)}}))
    with HubServer(tmp_path / "hub") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        err = _refused(capsys, monkeypatch, "--budget", "2m", "--model", "big-org/llama-7b",
                       "--cache-dir", str(tmp_path / "cache"))
    cfg = DiagnoseConfig.quick(model="big-org/llama-7b", cache_dir=str(tmp_path / "cache"))
    scaled = floors(Sizes(13_500_000_000, "hub"), cfg)
    need = sum(scaled[s.field][0] for s in steps(cfg) if s.field != "train")
    assert f"at least {clock(need)} (" in err and "from the model's 13.5 GB (hub)" in err
    assert not (tmp_path / "cache").exists()  # nothing downloaded, nothing made
