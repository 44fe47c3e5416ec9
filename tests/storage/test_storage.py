"""diag.storage on the embedded S3 server: the measurement frame, land() on prefixes, the tax."""

from __future__ import annotations

import base64
import json
import math
import os
import zlib
from pathlib import Path

import pandas as pd
import pytest

from diag import amdahl, plots
from diag.storage import landing, objectstore
from diag.cli import parse
from diag.config import StorageConfig
from diag.storage.landing import local_paths
from diag.storage import list_remote, parse_url
from diag.storage.objectstore import (MB, make_client, transfer_plan,
                              usable_cores)
from diag.embedded import S3Server
from diag.storage import advice, land, medians, pull, run_storage, storage_tax
from diag.storage.experiment import COLUMNS, s5cmd_path
from diag.timing import StageTimer


# its module fixture is made once: the file's tests share one xdist worker (make test)
pytestmark = pytest.mark.xdist_group("test_storage")


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    # the real experiment, test-sized: embedded server, synthetic data, every method, land()
    return run_storage(StorageConfig.quick(size_mb=3.0, repeats=2, land=True)).frame


def test_run_storage_frame_has_every_method_and_honest_labels(frame):
    assert list(frame.columns) == COLUMNS
    methods = set(frame["method"])
    assert {"boto3_default", "boto3_tuned", "local_read", "land"} <= methods
    # s5cmd_path() also finds it beside the venv's python (`make test` runs without it on PATH)
    assert ("s5cmd" in methods) == (s5cmd_path() is not None)
    assert set(frame["repeat"]) == {0, 1}  # the warm-up round is not reported
    pulls = frame[frame["method"].isin(["boto3_default", "boto3_tuned", "s5cmd"])]
    assert (pulls["cache_state"] == "remote").all()
    boto = pulls[pulls["method"] != "s5cmd"]
    assert (boto["ttfb_s"] > 0).all() and (boto["ttfb_s"] < boto["seconds"] * 5).all()
    assert pulls.loc[pulls["method"] == "s5cmd", "ttfb_s"].isna().all()  # not visible from here
    size = int(frame["bytes"].iloc[0])
    assert 2.9e6 < size < 3.2e6 and (frame["bytes"] == size).all()
    assert (frame["seconds"] > 0).all()
    assert frame["mb_per_s"].round(6).equals((frame["bytes"] / MB / frame["seconds"]).round(6))
    reads = frame[frame["method"] == "local_read"]
    states = set(reads["cache_state"])
    assert any(s.startswith("cold") for s in states) and any(s.startswith("warm") for s in states)
    # each label beside what mincore measured just before the timed read
    cold = reads[reads["cache_state"] == "cold"]
    assert len(cold) == 2 and (cold["resident_fraction"] <= 0.02).all()
    assert (reads.loc[reads["cache_state"] == "warm", "resident_fraction"] >= 0.98).all()
    staged = frame[frame["method"] == "land"]
    assert sorted(staged["cache_state"]) == ["hit", "hit", "miss", "miss"]
    # the hit is timed on a copy evicted from RAM (the miss had just written it), and says so
    hits = staged[staged["cache_state"] == "hit"]
    assert (hits["detail"] == "verify=sha256, page cache cold").all()
    assert (hits["resident_fraction"] <= 0.02).all()
    # the tuned row is land()'s own engine, checks included
    tuned = frame.loc[frame["method"] == "boto3_tuned", "detail"]
    assert tuned.str.startswith("land()'s engine: s3transfer, one GET").all()
    table = medians(frame)
    assert set(table["repeats"]) == {2}


def test_a_failed_eviction_is_never_called_cold(monkeypatch):
    # posix_fadvise doing nothing (as where DONTNEED is ignored): every figure stays warm and
    # says so, with the resident fraction that shows it
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: None)
    frame = run_storage(StorageConfig.quick(size_mb=1.0, repeats=1, warmup=0, land=True)).frame
    local = frame[frame["method"].isin(["local_read", "land"]) & (frame["cache_state"] != "miss")]
    assert len(local) == 3
    assert not local["cache_state"].str.startswith("cold").any()
    assert not (local["cache_state"] == "hit").any()  # the cold hit diagnose would use
    assert (local["resident_fraction"] > 0.9).all()


def test_transfer_plan_counts_the_cores_this_process_may_use():
    # a job pinned to a slice of the node (taskset, cpuset, Slurm) must not plan for the node
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs 2+ usable cores to pin the process to fewer")
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert usable_cores() == 1
        plan = transfer_plan(200 * MB)  # the default land() and the boto3_tuned row use
        assert (plan.part_bytes, plan.concurrency) == (100 * MB, 2)
    finally:
        os.sched_setaffinity(0, allowed)
    assert transfer_plan(200 * MB) == transfer_plan(200 * MB, cores=len(allowed))


def test_transfer_plan_follows_size_and_cores():
    small = transfer_plan(8 * MB, cores=2)
    assert 8 * MB < small.single_get_below
    assert ", one GET (" in landing.describe([objectstore.RemoteObject("k", 8 * MB, "e")])
    mid = transfer_plan(200 * MB, cores=2)
    assert (mid.part_bytes, mid.concurrency) == (50 * MB, 4)
    big = transfer_plan(25_000 * MB, cores=32)
    assert (big.part_bytes, big.concurrency) == (256 * MB, 64)
    assert transfer_plan(40 * MB, cores=64).part_bytes == 8 * MB  # never below 8 MB parts


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        client = server.client()
        for i in range(3):
            client.put_object(Bucket="diag", Key=f"shards/part-{i}.bin",
                              Body=os.urandom(200_000 + i))
        client.put_object(Bucket="diag", Key="shards/sub/deep.bin", Body=b"deep")
        yield server


def _client(server):
    return make_client(server.endpoint_url, credentials={
        "aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key,
        "region_name": server.region})


def test_land_prefix_lands_once_with_manifest_then_hits(s3, tmp_path):
    url = "s3://diag/shards/"
    client = _client(s3)
    timer = StageTimer()
    miss = land(url, tmp_path, client=client, timer=timer)
    assert miss.hit is False and miss.files == 4 and miss.bytes == miss.fetched_bytes == 600_007
    local, manifest_path = local_paths(parse_url(url), tmp_path)
    assert miss.path == local and (local / "sub" / "deep.bin").read_bytes() == b"deep"
    manifest = json.loads(manifest_path.read_text())
    assert [e["key"] for e in manifest["objects"]] == sorted(e["key"] for e in manifest["objects"])
    for e in manifest["objects"]:
        path = local / e["key"][len("shards/"):]
        # the whole file's CRC32, computed while it landed, is what a hit re-checks
        crc = base64.b64encode(zlib.crc32(path.read_bytes()).to_bytes(4, "big")).decode()
        assert path.stat().st_size == e["size"] and e["digest"] == f"crc32:{crc}"
    hit = land(url, tmp_path, client=client, timer=timer)
    assert hit.hit is True and hit.fetched_bytes == 0
    stages = timer.to_frame()
    assert list(stages["stage"]) == ["fetch_data", "fetch_data"]
    assert stages["seconds"].tolist() == pytest.approx([miss.seconds, hit.seconds], rel=0.5)

    # one shard changes, one disappears: only the changed one is fetched, the gone one removed
    s3.client().put_object(Bucket="diag", Key="shards/part-1.bin", Body=b"new bytes")
    s3.client().delete_object(Bucket="diag", Key="shards/part-2.bin")
    again = land(url, tmp_path, client=client)
    assert again.hit is False and again.fetched_bytes == len(b"new bytes") and again.files == 3
    assert (local / "part-1.bin").read_bytes() == b"new bytes"
    assert not (local / "part-2.bin").exists()
    assert land(url, tmp_path, client=client).hit is True


def test_land_without_client_pools_the_connections_its_plan_runs(s3, tmp_path, monkeypatch):
    # the standard AWS chain (env vars), as on a cloud box; 16 cores: the plan runs 32 parts
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(landing, "usable_cores", lambda: 16)
    monkeypatch.setattr(objectstore, "usable_cores", lambda: 16)
    made = []
    real = landing.make_client
    monkeypatch.setattr(landing, "make_client", lambda **kw: made.append(real(**kw)) or made[-1])
    got = land("s3://diag/shards/part-0.bin", tmp_path)
    assert got.hit is False and got.path.stat().st_size == 200_000
    assert transfer_plan(25_000 * MB).concurrency == 32
    assert [c.meta.config.max_pool_connections for c in made] == [32]


@pytest.mark.timeout(60)  # without the endpoint, s5cmd retries AWS (unreachable) for minutes
def test_s5cmd_gets_the_endpoint_boto3_found_in_an_aws_profile(s3, tmp_path, monkeypatch):
    if s5cmd_path() is None:
        pytest.skip("s5cmd is not installed")
    config = tmp_path / "aws-config"
    config.write_text(f"[profile diagtest]\nendpoint_url = {s3.endpoint_url}\n"
                      f"region = {s3.region}\n")
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_PROFILE", "diagtest")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    import boto3

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # a fresh session reads this config
    client = make_client()  # the endpoint comes from the profile only
    assert client.meta.endpoint_url == s3.endpoint_url
    url = parse_url("s3://diag/shards/part-0.bin")
    pull("s5cmd", client, url, list_remote(client, url), tmp_path / "out", dict(os.environ))
    assert (tmp_path / "out" / "part-0.bin").read_bytes() == (
        s3.client().get_object(Bucket="diag", Key=url.key)["Body"].read())


def test_manifest_is_what_makes_a_landing_complete(s3, tmp_path):
    url = "s3://diag/shards/part-0.bin"
    client = _client(s3)
    first = land(url, tmp_path, client=client)
    _, manifest_path = local_paths(parse_url(url), tmp_path)
    manifest_path.unlink()  # e.g. killed after the data rename, before the manifest
    second = land(url, tmp_path, client=client)
    assert second.hit is False and first.path.read_bytes() == second.path.read_bytes()


def test_storage_tax_arithmetic_and_advice_rows():
    rows = [{"method": m, "bytes": 200 * MB, "seconds": 200 / rate, "mb_per_s": rate,
             "cache_state": "remote", "repeat": r}
            for m, rates in {"boto3_default": (90, 100, 110),
                             "boto3_tuned": (240, 250, 260)}.items()
            for r, rate in enumerate(rates)]
    rows += [{"method": "local_read", "bytes": 200 * MB, "seconds": 0.1, "mb_per_s": 2000.0,
              "cache_state": "cold", "repeat": r} for r in range(3)]
    frame = pd.DataFrame(rows)
    tax = storage_tax(frame, dataset_gb=25, runs_per_week=10, usd_per_hour=3.6).set_index("method")
    assert tax.loc["boto3_default", "seconds_per_run"] == pytest.approx(250.0)  # 25 GB at 100 MB/s
    assert tax.loc["boto3_default", "usd_per_run"] == pytest.approx(0.25)
    assert tax.loc["boto3_default", "hours_per_week"] == pytest.approx(2500 / 3600)
    assert tax.loc["boto3_tuned", "seconds_per_run"] == pytest.approx(100.0)
    assert tax.loc["boto3_tuned", "evidence"] == (
        "25 GB at 250 MB/s (boto3_tuned, measured on 200 MB) = 1.7 min per start (median of 3 "
        "rounds, 1.6-1.7 min)")
    unknown = storage_tax(frame).set_index("method")  # measured size, no price
    assert unknown.loc["boto3_default", "dataset_gb"] == pytest.approx(0.2)
    assert math.isnan(unknown.loc["boto3_default", "usd_per_week"])

    fix = advice(storage_tax(frame, dataset_gb=25), frame)
    assert list(fix.columns) == ["stage", "finding", "seconds_saved", "evidence"]
    assert (fix["stage"] == "fetch_data").all() and len(fix) == 2
    assert fix["seconds_saved"].tolist() == pytest.approx([250 - 12.5, 150.0])
    assert "2000 MB/s (cold)" in fix["evidence"].iloc[0]
    # what a user pastes, for the 25 GB object at this machine's cores, and the alternatives
    plan = transfer_plan(25 * 10**9)
    tune = fix["finding"].iloc[1]
    assert (f"`TransferConfig(multipart_threshold=32000000, multipart_chunksize="
            f"{plan.part_bytes}, max_concurrency={plan.concurrency})`") in tune
    assert f"`s3 =` / `  max_concurrent_requests = {plan.concurrency}`" in tune
    assert f"`  multipart_chunksize = {plan.part_bytes // MB}MB`" in tune
    assert f"`s5cmd --numworkers {plan.concurrency} cp --concurrency {plan.concurrency}" in tune
    for alternative in ("`s5cmd sync`", "`aws s3 sync`", "Mountpoint for S3", "FSx for Lustre"):
        assert alternative in fix["finding"].iloc[0]
    run = pd.DataFrame({"stage": ["fetch_data", "eval"], "seconds": [250.0, 1000.0]})
    assert "diag.storage.land" in fix["finding"].iloc[0]
    ranked = amdahl.findings(run, advice=fix)
    assert "diag.storage.land" in " ".join(ranked["finding"])
    with pytest.raises(ValueError, match="no pull rows"):
        storage_tax(frame[frame["method"] == "local_read"])


def test_advice_takes_a_hit_from_the_measured_cold_land_hit():
    # the figure diagnose uses as the optimized fetch_data: the median cold "hit" row
    rows = [{"method": "boto3_default", "bytes": 200 * MB, "seconds": 2.0, "mb_per_s": 100.0,
             "cache_state": "remote", "repeat": r, "detail": ""} for r in range(3)]
    rows += [{"method": "local_read", "bytes": 200 * MB, "seconds": 0.1, "mb_per_s": 2000.0,
              "cache_state": "cold", "repeat": r, "detail": ""} for r in range(3)]
    rows += [{"method": "land", "bytes": 200 * MB, "seconds": s, "mb_per_s": 200 / s,
              "cache_state": state, "repeat": r, "detail": "verify=sha256, page cache cold"}
             for r, s, state in [(0, 0.5, "hit"), (1, 0.7, "hit"), (2, 0.6, "hit"),
                                 (0, 0.01, "hit (page cache warm)"), (0, 9.0, "miss")]]
    frame = pd.DataFrame(rows)
    measured = advice(storage_tax(frame), frame)  # dataset = the measured 200 MB
    assert measured["seconds_saved"].iloc[0] == pytest.approx(2.0 - 0.6)
    scaled = advice(storage_tax(frame, dataset_gb=25), frame)  # 125 x the measured bytes
    assert scaled["seconds_saved"].iloc[0] == pytest.approx(250.0 - 0.6 * 125)
    assert "measured 0.6 s on 200 MB, median of 3, verify=sha256, page cache cold" in (
        scaled["evidence"].iloc[0])


def test_plot_storage_draws_every_method(frame):
    fig = plots.plot_storage(frame)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert any(label.startswith("boto3_tuned") for label in labels)
    assert len(labels) == len(medians(frame))
    with pytest.raises(ValueError):
        plots.plot_storage(pd.DataFrame())


def test_config_and_cli_flags():
    _, cfg, _ = parse(["storage", "--source", "s3://b/data/", "--local-dir", "/mnt/nvme/x",
                       "--dataset-gb", "25", "--verify", "size"])
    assert isinstance(cfg, StorageConfig)
    assert (cfg.source, cfg.local_dir, cfg.dataset_gb, cfg.verify) == (
        "s3://b/data/", "/mnt/nvme/x", 25.0, "size")
    assert (cfg.retries, cfg.profile, cfg.region, cfg.sign_request) == (None, "", "", True)
    _, cfg, _ = parse(["storage", "--source", "s3://b/k", "--retries", "0", "--profile", "p",
                       "--region", "eu-west-1", "--no-sign-request"])
    assert (cfg.retries, cfg.profile, cfg.region, cfg.sign_request) == (0, "p", "eu-west-1", False)
    for bad, field in [({"source": "/data/x"}, "source"), ({"verify": "md5"}, "verify"),
                       ({"repeats": 0}, "repeats"), ({"usd_per_hour": -1.0}, "usd_per_hour"),
                       ({"retries": -1}, "retries")]:
        with pytest.raises(ValueError, match=f"StorageConfig.{field}"):
            StorageConfig(**bad)


def test_run_storage_on_a_prefix_source(s3, tmp_path):
    cfg = StorageConfig.quick(source="s3://diag/shards/", endpoint_url=s3.endpoint_url,
                              local_dir=str(tmp_path), repeats=1, warmup=0)
    env = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
           "AWS_DEFAULT_REGION": s3.region}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the standard credential chain, as on a cloud box
    try:
        frame = run_storage(cfg).frame
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    listed = s3.client().list_objects_v2(Bucket="diag", Prefix="shards/")["Contents"]
    assert set(frame["files"]) == {len(listed)} and len(listed) > 1
    assert (frame["bytes"] == sum(o["Size"] for o in listed)).all()
    assert list(Path(tmp_path).iterdir()) == []  # the scratch copies are cleaned up


def test_a_crc_this_python_cannot_compute_is_recorded_as_not_checked(tmp_path, monkeypatch):
    # CRC32C / CRC64NVME need awscrt (in the storage extra; what botocore uses for them): an
    # install without it gets a manifest that says the stored checksum was not checked, instead
    # of one claiming a check that never ran
    import sys

    from diag.storage import checks

    monkeypatch.setitem(sys.modules, "awscrt", None)  # import awscrt raises ImportError
    stream = checks.Stream(os.open(tmp_path / "x.bin", os.O_RDWR | os.O_CREAT), checks.Expected(
        crc=("crc64nvme", "AAAAAAAAAAA=")), 4000)
    stream.write(b"diag" * 1000)
    digest, checked = stream.finish().verdict()
    crc = base64.b64encode(zlib.crc32(b"diag" * 1000).to_bytes(4, "big")).decode()
    assert digest == f"crc32:{crc}"  # the manifest's digest falls back to CRC32 (zlib)
    assert checked == "size (crc64nvme stored, not checked: pip install awscrt)"
