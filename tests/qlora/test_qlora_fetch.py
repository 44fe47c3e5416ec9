"""The job's comparison moves what it trains on (issue 32 item 4): a round fetches the shards its
records are in, pulled or landed, and the whole source's fetch is extrapolated from them."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from diag.data.records import shard_files
from diag.qlora.eta import from_runs
from diag.qlora.job import Sources, fetch_data
from diag.qlora.plans import Plan
from diag.storage import make_client

SHARDS, PER_SHARD = 4, 10


@pytest.fixture(scope="module")
def src():
    from diag.embedded import S3Server

    with S3Server() as server:
        client = make_client(server.endpoint_url, credentials={
            "aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key,
            "region_name": server.region})
        for i in range(SHARDS):
            body = "".join(json.dumps({"text": f"shard {i} record {j}"}) + "\n"
                           for j in range(PER_SHARD))
            client.put_object(Bucket="diag", Key=f"sft/part-{i}.jsonl", Body=body.encode())
        yield Sources("s3://diag/sft/", client, "unused", None)


@pytest.mark.parametrize("fetch", ["pull", "land"])
def test_a_round_fetches_the_shards_its_records_are_in(src, tmp_path, monkeypatch, fetch):
    monkeypatch.setenv("DIAG_HOME", str(tmp_path / "home"))  # where land() keeps its copy
    plan = dataclasses.replace(Plan.naive(), fetch=fetch)
    sizes = [o["Size"] for o in src.client.list_objects_v2(Bucket="diag", Prefix="sft/")[
        "Contents"]]
    path, fetched, whole = fetch_data(plan, src, tmp_path / "work", records=PER_SHARD + 5)
    files = shard_files(path)  # what the job reads: the data, never a landing's manifest
    assert [f.name for f in files] == ["part-0.jsonl", "part-1.jsonl"]
    assert (fetched, whole) == (sizes[0] + sizes[1], sum(sizes))
    # no records asked for: the whole source (diag train's fetch)
    path, fetched, whole = fetch_data(plan, src, tmp_path / "work2", records=0)
    assert len(shard_files(path)) == SHARDS and fetched == whole == sum(sizes)


def test_the_whole_sources_fetch_is_extrapolated_from_the_shards_fetched():
    frame = pd.DataFrame([{"plan": "naive", "token_slots": 400, "steps": 4, "records": 15,
                           "fetched_bytes": 1_000_000, "source_bytes": 25_000_000}])
    stages = pd.DataFrame([{"run": "naive", "stage": s, "seconds": v, "step": None}
                           for s, v in (("fetch_data", 0.2), ("load_model", 1.0),
                                        ("setup", 0.5), ("train", 4.0))])
    costs = from_runs(frame, stages).set_index("stage")
    assert costs.loc["fetch_data", "seconds"] == pytest.approx(0.2 * 25)
    assert "extrapolated from the 1 MB its records were in" in costs.loc["fetch_data",
                                                                         "evidence"]
    assert costs.loc["load_model", "seconds"] == 1.0  # a start's other costs as they ran
