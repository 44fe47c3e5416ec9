"""The storage sample's stopping rule on a constructed one-object source (a clock the test moves,
no server): a one-object sample goes on past its time until it holds its floor of bytes (as
many as boto3's default pull has in flight), unless the cap (its share, --sample-mb) comes
first; objects stop at the time alone."""

from __future__ import annotations

import time

import pytest

from diag.storage.objectstore import MB, RemoteObject
from diag.storage.sample import RANGE_SAMPLE_AT_LEAST, probe, ranges, spread


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    return now


def _pull_one_second(clock):
    def pull_one(piece, before):
        clock[0] += 1.0  # every piece takes a second: the time is spent after the first

    return pull_one


def test_a_one_object_sample_holds_its_floor_however_slow_its_pieces(clock):
    pieces = spread(ranges(RemoteObject("big/data.jsonl", 384 * 2**20, "e")))
    assert pieces[0].size < RANGE_SAMPLE_AT_LEAST  # 48 MiB ranges on 2 cores: one is under it
    got = probe(pieces, _pull_one_second(clock), seconds=0.5, cap_bytes=0,
                least=RANGE_SAMPLE_AT_LEAST)
    assert got["sample_bytes"].iloc[-1] >= RANGE_SAMPLE_AT_LEAST
    assert got["sample_bytes"].iloc[-2] < RANGE_SAMPLE_AT_LEAST  # and stops once it holds it
    assert got["sample_seconds"].iloc[-1] == len(got) > 1


def test_the_cap_comes_before_the_floor_and_objects_stop_at_the_time(clock):
    pieces = spread(ranges(RemoteObject("big/data.jsonl", 384 * 2**20, "e")))
    capped = probe(pieces, _pull_one_second(clock), seconds=0.5, cap_bytes=pieces[0].size + 1,
                   least=RANGE_SAMPLE_AT_LEAST)
    assert list(capped["bytes"]) == [pieces[0].size]  # a second piece would pass the cap
    objects = spread([RemoteObject(f"many/{i}", 8 * MB, "e") for i in range(40)])
    timed = probe(objects, _pull_one_second(clock), seconds=2.5, cap_bytes=0)
    assert len(timed) == 3  # 3 s spent: the time is up, no floor to reach
    untimed = probe(objects, _pull_one_second(clock), seconds=0, cap_bytes=20 * 8 * MB)
    assert len(untimed) == 20  # no time limit: up to the cap
