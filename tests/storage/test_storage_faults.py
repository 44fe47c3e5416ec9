"""land() under real faults: a proxy that cuts connections or flips bits, SIGKILL mid-download,
corrupted copies, a full disk, missing objects and unreachable endpoints
(tests/storage/test_storage_cli.py has the errors a user sees from the command line, with no
secret in any of them)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from diag.embedded import S3Server
from diag.storage import landing
from diag.storage.landing import land, local_paths
from diag.storage import parse_url
from diag.storage.objectstore import MB, TransferPlan, make_client
from tests.s3proxy import Proxy

ROOT = Path(__file__).resolve().parents[2]
SIZE = 3_000_000


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        client = server.client()
        client.put_object(Bucket="diag", Key="data/obj.bin", Body=os.urandom(SIZE))
        yield server


def client_for(server: S3Server, endpoint: str | None = None, retries: int = 1):
    return make_client(endpoint or server.endpoint_url, retries=retries, credentials={
        "aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key,
        "region_name": server.region})


def remote_bytes(server: S3Server, key: str = "data/obj.bin") -> bytes:
    return server.client().get_object(Bucket="diag", Key=key)["Body"].read()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def test_dropped_connection_leaves_nothing_then_retry_is_byte_identical(s3, tmp_path):
    url = "s3://diag/data/obj.bin"
    final, manifest = local_paths(parse_url(url), tmp_path)
    proxy = Proxy(s3.port, cut_after=SIZE // 3, cuts=100)
    try:
        with pytest.raises(RuntimeError, match=r"connection dropped 2 times .* gave up") as err:
            land(url, tmp_path, client=client_for(s3, proxy.url), retries=1)
        assert proxy.url in str(err.value) and url in str(err.value)
        assert not final.exists() and not manifest.exists()
        assert leftovers(tmp_path) == []  # no partial file either
    finally:
        proxy.close()
    proxy = Proxy(s3.port, cut_after=SIZE // 3, cuts=3)
    try:
        got = land(url, tmp_path, client=client_for(s3, proxy.url), retries=4)
    finally:
        proxy.close()
    assert proxy.cut == 3  # three drops, each GET again by s3transfer
    assert got.hit is False and got.path == final
    assert final.read_bytes() == remote_bytes(s3)
    assert leftovers(tmp_path) == sorted([final.name, manifest.name])


def test_a_dropped_part_is_fetched_again_whole_and_costs_at_most_one_part(s3, tmp_path,
                                                                          monkeypatch):
    # What replaced diag's resume-from-the-last-byte: s3transfer GETs a dropped part again from
    # the part's first byte. A drop then wastes at most one part (<= 256 MB: ~1-3 s at S3
    # rates), which is why resuming inside a part was not kept.
    part = MB
    monkeypatch.setattr(landing, "transfer_plan",
                        lambda size, cores=None: TransferPlan(part, part, 2))
    url = "s3://diag/data/obj.bin"
    proxy = Proxy(s3.port, cut_after=part // 2, cuts=2)  # two part responses cut half-way
    try:
        got = land(url, tmp_path, client=client_for(s3, proxy.url), retries=2)
    finally:
        proxy.close()
    assert proxy.cut == 2 and got.path.read_bytes() == remote_bytes(s3)
    spans = [span for line, span in proxy.requests if line.startswith("GET ") and span]
    # s3transfer asks for the last part open-ended ("bytes=2000000-")
    parts = [(s, s + part - 1 if s + part < SIZE else None) for s in range(0, SIZE, part)]
    assert set(spans) == set(parts)  # every request starts on a part boundary: no resume...
    assert len(spans) == len(parts) + 2  # ...and the two cut parts were asked for again whole
    assert SIZE < proxy.served < SIZE + 2 * part  # each drop cost less than one part


@pytest.mark.parametrize("checksum", ["etag-md5", "crc"])
def test_bytes_corrupted_in_transit_never_land(s3, tmp_path, checksum):
    # etag-md5: an object stored without an SDK checksum (older tools): only the single-part
    # ETag (its MD5) can catch a flipped bit; crc: boto3 stored a CRC that botocore checks
    key = f"data/{checksum}.bin"
    if checksum == "crc":
        s3.client().put_object(Bucket="diag", Key=key, Body=remote_bytes(s3))
    else:
        import boto3
        from botocore.config import Config

        plain = boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.access_key,
                             aws_secret_access_key=s3.secret_key, region_name=s3.region,
                             config=Config(request_checksum_calculation="when_required"))
        plain.put_object(Bucket="diag", Key=key, Body=remote_bytes(s3))
        head = plain.head_object(Bucket="diag", Key=key, ChecksumMode="ENABLED")
        assert not [h for h in head if h.startswith("Checksum")]  # nothing but the ETag
    url = f"s3://diag/{key}"
    final, manifest = local_paths(parse_url(url), tmp_path)
    proxy = Proxy(s3.port, flip_at=SIZE // 2, flips=100)  # every connection: a persistent fault
    try:
        with pytest.raises(RuntimeError, match=r"do not match the object .* in 3 downloads") as err:
            land(url, tmp_path, client=client_for(s3, proxy.url), retries=4)
    finally:
        proxy.close()
    assert proxy.flipped >= 1 and url in str(err.value) and proxy.url in str(err.value)
    assert not final.exists() and not manifest.exists() and leftovers(tmp_path) == []
    proxy = Proxy(s3.port, flip_at=SIZE // 2, flips=1)  # once: fetched again, lands whole
    try:
        got = land(url, tmp_path, client=client_for(s3, proxy.url), retries=4)
    finally:
        proxy.close()
    assert proxy.flipped == 1 and got.hit is False and got.fetched_bytes == SIZE
    assert final.read_bytes() == remote_bytes(s3, key)
    assert leftovers(tmp_path) == sorted([final.name, manifest.name])


def test_multipart_object_failing_its_full_object_crc_never_lands(s3, tmp_path, monkeypatch):
    # A multipart ETag ("...-3") is no MD5 of the bytes: only the CRC32 the store keeps for the
    # whole object (uploaded with a full-object checksum, ChecksumType FULL_OBJECT) can catch a
    # bit flipped in a ranged part; botocore checks no checksum on a ranged GET.
    import base64
    import json
    import zlib

    from boto3.s3.transfer import TransferConfig

    part, key = 4 * MB, "data/multipart-crc.bin"  # S3 parts are >= 5 MiB: 3 of them in 11 MB
    source = tmp_path / "upload.bin"
    source.write_bytes(os.urandom(11 * MB))
    crc = base64.b64encode(zlib.crc32(source.read_bytes()).to_bytes(4, "big")).decode()
    s3.client().upload_file(str(source), "diag", key, ExtraArgs={"ChecksumCRC32": crc},
                            Config=TransferConfig(multipart_threshold=5 << 20,
                                                  multipart_chunksize=5 << 20))
    head = s3.client().head_object(Bucket="diag", Key=key, ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-3"') and head["ChecksumType"] == "FULL_OBJECT"
    monkeypatch.setattr(landing, "transfer_plan",
                        lambda size, cores=None: TransferPlan(part, part, 2))
    url, cache = f"s3://diag/{key}", tmp_path / "cache"
    final, manifest = local_paths(parse_url(url), cache)
    proxy = Proxy(s3.port, flip_at=part // 2, flips=1000)  # every part: a persistent fault
    try:
        for _ in range(2):  # the failed landing is no hit on the next run: it fails the same way
            with pytest.raises(RuntimeError, match=r"full-object CRC32 .* in 3 downloads") as err:
                land(url, cache, client=client_for(s3, proxy.url))
            assert url in str(err.value) and not final.exists() and not manifest.exists()
            assert leftovers(cache) == []
    finally:
        proxy.close()
    assert proxy.flipped >= 6
    got = land(url, cache, client=client_for(s3))
    assert got.hit is False and final.read_bytes() == source.read_bytes()
    entry = json.loads(manifest.read_text())["objects"][0]
    assert entry["checks"] == "size, full-object CRC32"


def test_sigkill_mid_download_is_not_taken_for_a_hit(s3, tmp_path):
    url = "s3://diag/data/obj.bin"
    final, manifest = local_paths(parse_url(url), tmp_path)
    proxy = Proxy(s3.port, rate=1_000_000)  # ~3 s for the object: time to kill it half-way
    script = textwrap.dedent(f"""
        from diag.storage.landing import land
        from diag.storage.objectstore import make_client
        client = make_client({proxy.url!r}, credentials={{"aws_access_key_id": {s3.access_key!r},
            "aws_secret_access_key": {s3.secret_key!r}, "region_name": "us-east-1"}})
        land({url!r}, {str(tmp_path)!r}, client=client)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    prefix = f".{final.name}.tmp-{proc.pid}-"  # diag.files.temp_path's name for it
    partials = lambda: [p for p in tmp_path.rglob(prefix + "*")]  # noqa: E731
    try:
        deadline = time.perf_counter() + 30
        while not (partials() and partials()[0].stat().st_size > SIZE // 10):
            assert proc.poll() is None, "the download finished before it could be killed"
            assert time.perf_counter() < deadline, "no partial file appeared"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    assert proc.returncode == -signal.SIGKILL
    assert partials() and not final.exists() and not manifest.exists()
    got = land(url, tmp_path, client=client_for(s3))
    assert got.hit is False and final.read_bytes() == remote_bytes(s3)
    assert not partials()  # the dead process's partial was removed, never trusted


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_copy_is_detected_and_fetched_again(s3, tmp_path, damage):
    url = "s3://diag/data/obj.bin"
    client = client_for(s3)
    gets = []
    client.meta.events.register("before-call.s3.GetObject", lambda **kw: gets.append(1))
    first = land(url, tmp_path, client=client)
    assert first.hit is False and gets
    gets.clear()
    assert land(url, tmp_path, client=client).hit is True and gets == []  # a hit GETs nothing
    with open(first.path, "r+b") as f:
        if damage == "flip":
            f.seek(SIZE // 2)
            byte = f.read(1)
            f.seek(SIZE // 2)
            f.write(bytes([byte[0] ^ 0x01]))
        else:
            f.truncate(SIZE - 1000)
    again = land(url, tmp_path, client=client)
    assert again.hit is False and again.fetched_bytes == SIZE and gets
    assert first.path.read_bytes() == remote_bytes(s3)
    assert land(url, tmp_path, client=client).hit is True


def test_verify_size_is_cheap_but_blind_to_a_flipped_byte(s3, tmp_path):
    # the documented trade-off of verify="size": truncation is caught, a same-size flip is not
    url = "s3://diag/data/obj.bin"
    client = client_for(s3)
    path = land(url, tmp_path, client=client).path
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))  # flipped: urandom's first byte may already be 0
    assert land(url, tmp_path, client=client, verify="size").hit is True
    assert land(url, tmp_path, client=client, verify="sha256").hit is False
    os.truncate(path, 10)
    assert land(url, tmp_path, client=client, verify="size").hit is False
    assert path.read_bytes() == remote_bytes(s3)


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 2 MB tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_not_enough_disk_is_a_clear_error_before_any_download(s3, small_disk):
    client = client_for(s3)
    gets = []
    client.meta.events.register("before-call.s3.GetObject", lambda **kw: gets.append(1))
    with pytest.raises(RuntimeError, match="not enough free disk") as err:
        land("s3://diag/data/obj.bin", small_disk / "cache", client=client)
    text = str(err.value)
    assert f"need {SIZE:,} bytes" in text and str(small_disk) in text and "free" in text
    assert gets == []  # refused before a single GET
    assert leftovers(small_disk) == []


def test_disk_refusal_keeps_a_valid_landing_valid(s3, small_disk):
    # the object grew past the free space: refused; the old copy and its manifest still stand,
    # so once the object is back the next call hits instead of pulling it all again
    url, key, small = "s3://diag/data/small.bin", "data/small.bin", os.urandom(100_000)
    s3.client().put_object(Bucket="diag", Key=key, Body=small)
    client = client_for(s3)
    assert land(url, small_disk / "cache", client=client).hit is False
    _, manifest = local_paths(parse_url(url), small_disk / "cache")
    s3.client().put_object(Bucket="diag", Key=key, Body=os.urandom(SIZE))
    with pytest.raises(RuntimeError, match="not enough free disk"):
        land(url, small_disk / "cache", client=client)
    assert manifest.exists()
    s3.client().put_object(Bucket="diag", Key=key, Body=small)  # same bytes: same ETag
    gets = []
    client.meta.events.register("before-call.s3.GetObject", lambda **kw: gets.append(1))
    assert land(url, small_disk / "cache", client=client).hit is True and gets == []


def test_missing_bucket_key_prefix_and_refused_connection(s3, tmp_path):
    client = client_for(s3)
    cases = {"s3://nope/data/obj.bin": "bucket does not exist at this endpoint .*check --source",
             "s3://diag/data/missing.bin": "no such object .*check the key in --source",
             "s3://diag/nothing-here/": "no objects under this prefix .*check --source"}
    for url, message in cases.items():
        with pytest.raises(RuntimeError, match=message) as err:
            land(url, tmp_path, client=client)
        assert url in str(err.value) and s3.endpoint_url in str(err.value)
    with socket.create_server(("127.0.0.1", 0)) as s:
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RuntimeError,
                       match="cannot connect .*--endpoint-url / AWS_ENDPOINT_URL") as err:
        land("s3://diag/data/obj.bin", tmp_path, client=client_for(s3, closed, retries=0))
    assert closed in str(err.value)
    with pytest.raises(ValueError, match="s3://bucket/key"):
        land("https://example.com/x", tmp_path, client=client)
    assert leftovers(tmp_path) == []
