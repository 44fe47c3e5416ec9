"""Storage at the user's scale (issue 32 item 2): each method pulls a sample of whole objects
spread over their sizes, sized to the budget, and the whole pull is extrapolated from it with
its per-object overhead; land() of the whole dataset only with --land; the disk is checked for
what is written."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple

import pandas as pd
import pytest

from diag import plots
from diag.config import StorageConfig
from diag.report import headline
from diag.storage import run_storage
from diag.storage.objectstore import MB, RemoteObject
from diag.storage.sample import Extrapolation, spread

pytestmark = pytest.mark.xdist_group("test_storage_sample")

SHARDS, SHARD_BYTES = 12, 250_000


@pytest.fixture(scope="module")
def s3():
    from diag.embedded import S3Server

    with S3Server() as server:
        client = server.client()
        for i in range(SHARDS):  # sizes 250 KB .. 525 KB: a spread a sample must represent
            client.put_object(Bucket="diag", Key=f"many/part-{i:03d}.bin",
                              Body=os.urandom(SHARD_BYTES + i * 25_000))
        yield server


def _cfg(s3, tmp_path, **more) -> StorageConfig:
    return StorageConfig.quick(source="s3://diag/many/", endpoint_url=s3.endpoint_url,
                               local_dir=str(tmp_path), repeats=1, warmup=0, **more)


def _run(s3, cfg):
    keys = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_DEFAULT_REGION": s3.region}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in keys.items():
            mp.setenv(k, v)  # the standard credential chain, as on a cloud box
        return run_storage(cfg)


def test_a_capped_sample_is_whole_objects_and_the_whole_pull_is_extrapolated(s3, tmp_path):
    got = _run(s3, _cfg(s3, tmp_path, sample_mb=1.2))
    whole = sum(SHARD_BYTES + i * 25_000 for i in range(SHARDS))
    pulls = got.frame[got.frame["method"] == "boto3_default"]
    assert (pulls["dataset_bytes"] == whole).all() and (pulls["dataset_files"] == SHARDS).all()
    n, sampled = int(pulls["files"].iloc[0]), int(pulls["bytes"].iloc[0])
    assert 1 < n < SHARDS and sampled <= 1.2 * MB  # whole objects, under the cap
    assert set(got.sample["key"]) <= {f"many/part-{i:03d}.bin" for i in range(SHARDS)}
    assert int(got.sample["bytes"].sum()) == sampled
    # spread over the sizes: neither the smallest nor the first keys only
    assert got.sample["bytes"].max() > SHARD_BYTES + SHARDS // 2 * 25_000
    # the whole pull is more than the sample's, by about the byte ratio (the overhead per object
    # is small beside 250 KB+ objects here)
    ratio = pulls["extrapolated_s"] / pulls["seconds"]
    assert ((ratio > 0.7 * whole / sampled) & (ratio < 1.5 * whole / sampled)).all()
    assert f"{n} of {SHARDS} objects" in pulls["sampled"].iloc[0]
    tax = got.tax.set_index("method").loc["boto3_default"]
    assert tax["dataset_gb"] == pytest.approx(whole / 1e9)
    assert "extrapolated from a sample of" in tax["evidence"]
    fetch = got.decisions[0]
    assert f"{n} of {SHARDS} objects" in fetch.measured_on.step
    assert "estimated" in fetch.why  # no land() ran: the hit is the sample's cold read, scaled
    assert fetch.baseline_s == pytest.approx(pulls["extrapolated_s"].median())
    assert "land" not in set(got.frame["method"])


def test_a_budget_sizes_the_sample(s3, tmp_path):
    # a budget no pull fits: the probe stops after its first object, and every method pulls
    # that one object
    got = _run(s3, _cfg(s3, tmp_path, budget_s=1e-3))
    pulls = got.frame[got.frame["method"].isin(["boto3_default", "boto3_tuned", "s5cmd"])]
    assert len(got.sample) == 1 and (pulls["files"] == 1).all()
    assert (pulls["bytes"] == got.sample["bytes"].iloc[0]).all()


def test_the_disk_is_checked_for_what_is_written(s3, tmp_path, monkeypatch):
    # free space for the sample and one pull of it, not for the dataset twice (what landing
    # it would need): the sampled run goes on, --land is refused before it lands
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, int(2.5 * MB)))
    got = _run(s3, _cfg(s3, tmp_path, sample_mb=1.0))
    assert int(got.sample["bytes"].sum()) <= MB
    with pytest.raises(RuntimeError, match="not enough free disk to land s3://diag/many/"):
        _run(s3, _cfg(s3, tmp_path, sample_mb=1.0, land=True))
    assert list(tmp_path.iterdir()) == []  # the scratch copies are cleaned up


def test_every_prefix_of_the_spread_order_spans_the_sizes():
    objects = [RemoteObject(f"k{i:03d}", size, "e") for i, size in
               enumerate(reversed(range(1, 101)))]  # keys in the opposite order to sizes
    order = spread(objects)
    assert sorted(o.key for o in order) == sorted(o.key for o in objects)  # each object once
    assert [o.size for o in order[:3]] == [51, 26, 76]  # the median, then the quartiles
    first8 = sorted(o.size for o in order[:8])
    assert first8[0] < 20 and first8[-1] > 80


def test_the_extrapolation_counts_the_per_object_overhead():
    # each object: 20 ms of requests plus its bytes at 100 MB/s; the sample holds larger
    # objects than the dataset's mean, so scaling by bytes alone would be 2x short
    times = [(s, 0.02 + s / (100 * MB)) for s in (1 * MB, 2 * MB, 4 * MB)]
    frame = pd.DataFrame({"bytes": [s for s, _ in times], "seconds": [t for _, t in times]})
    frame["sample_bytes"] = frame["bytes"].cumsum()
    frame["sample_mb_per_s"] = frame["sample_bytes"] / MB / frame["seconds"].cumsum()
    fit = Extrapolation.fit(frame, dataset_bytes=700 * MB, dataset_files=1000)
    assert fit.overhead_s == pytest.approx(0.02) and fit.bytes_per_s == pytest.approx(100 * MB)
    sample_s = sum(t for _, t in times)
    assert sample_s * fit.factor == pytest.approx(1000 * 0.02 + 700 / 100)
    assert "3 of 1000 objects" in fit.label() and "extrapolated" in fit.label()


ONE_OBJECT = 4_000_000  # 8 ranges of 500 KB


@pytest.fixture(scope="module")
def one(s3):
    body = os.urandom(ONE_OBJECT)
    s3.client().put_object(Bucket="diag", Key="one/data.jsonl", Body=body)
    return body


def test_one_object_is_sampled_by_byte_ranges_spread_over_it(s3, one, tmp_path):
    got = _run(s3, StorageConfig.quick(source="s3://diag/one/data.jsonl", repeats=2, warmup=0,
                                       endpoint_url=s3.endpoint_url, local_dir=str(tmp_path),
                                       sample_mb=1.5))
    pulls = got.frame[got.frame["method"].isin(["boto3_default", "boto3_tuned"])]
    assert set(pulls["method"]) == {"boto3_default", "boto3_tuned"}
    assert (pulls["bytes"] == 1_500_000).all() and (pulls["files"] == 3).all()  # < the object
    assert (pulls["dataset_bytes"] == ONE_OBJECT).all() and (pulls["dataset_files"] == 1).all()
    # the middle, then the quarters: spread over the object, not its first MB
    assert got.sample["start"].tolist() == [2_000_000, 1_000_000, 3_000_000]
    # equal ranges: no per-range overhead separable, the whole is 8 ranges' worth of 3
    assert (pulls["extrapolated_s"] / pulls["seconds"]).round(6).eq(round(8 / 3, 6)).all()
    label = pulls["sampled"].iloc[0]
    assert label.startswith("3 ranges of 0.5 MB spread over the one object's 4 MB (1.5 MB, 37.5%)")
    # each round's estimate of the whole pull: the median, their range and count, everywhere
    tax = got.tax.set_index("method")
    assert "extrapolated from 3 ranges" in tax.loc["boto3_default", "evidence"]
    assert "per start (median of 2 rounds, " in tax.loc["boto3_default", "evidence"]
    assert "(median of 2 rounds, " in got.decisions[0].why
    top = pd.DataFrame([{**got.advice.iloc[0].to_dict(), "run": "naive", "share_of_run": 1.0}])
    stages = pd.DataFrame([{"run": r, "stage": "fetch_data", "seconds": 1.0, "share": 1.0}
                           for r in ("naive", "optimized")])
    assert "extrapolated from a sample, median of 2 rounds, " in headline(stages, top)["top_fix"]
    s5cmd = got.frame[got.frame["method"] == "s5cmd"]
    if not s5cmd.empty:  # installed: a row saying why it was not measured, no figures
        assert s5cmd["seconds"].isna().all() and "no byte range" in s5cmd["detail"].iloc[0]
        assert "no byte range" in tax.loc["s5cmd", "evidence"]
        plots.plot_storage(got.frame)  # no bar for it


def test_a_range_pull_lands_the_bytes_at_their_offsets(s3, one, tmp_path):
    from diag.storage import list_remote, parse_url, pull
    from diag.storage.sample import ranges

    url = parse_url("s3://diag/one/data.jsonl")
    pieces = ranges(list_remote(s3.client(), url)[0])
    assert len(pieces) == 8 and sum(p.size for p in pieces) == ONE_OBJECT
    for method in ("boto3_default", "boto3_tuned"):
        pull(method, s3.client(), url, pieces[5:7], tmp_path / method)
        for p in pieces[5:7]:
            assert (tmp_path / method / p.name).read_bytes() == one[p.start:p.start + p.size]
    with pytest.raises(ValueError, match="method='s5cmd': pulls whole objects only"):
        pull("s5cmd", s3.client(), url, pieces[:1], tmp_path / "s5cmd")
