"""The job's comparison moves what it trains on (issue 32 item 4): a round fetches the shards its
records are in, pulled or landed, and the whole source's fetch is extrapolated from them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from diag.data.records import shard_files
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


def test_the_whole_sources_fetch_is_priced_from_the_share_of_it_fetched():
    # a round that fetched 1 MB of a 25 MB source counts 1/25 of a whole fetch: a whole
    # source costs 25 times that round's fetch (diag.forecast.eta.run_counts' "source" unit)
    from diag.forecast.costs import measured, price, row, table
    from diag.forecast.eta import run_counts

    summary = {"fetched_bytes": 1_000_000, "source_bytes": 25_000_000, "records": 15,
               "warmup_steps": 1, "steps": 4, "token_slots": 400, "saves": 1}
    n = run_counts(summary)
    assert n["source"] == pytest.approx(1 / 25)
    costs = table(measured([row("naive", "fetch_data", "source", 0.2, n["source"])]))
    whole = price(costs, {"source": 1}).set_index("stage")
    assert whole.at["fetch_data", "seconds"] == pytest.approx(0.2 * 25)
