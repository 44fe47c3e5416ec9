"""The checksums real S3 stores, checked while the bytes stream: composite multipart CRCs part by
part, CRC32C and CRC64NVME (awscrt), the landed size against the listed size, and the streamed
hashes against the file when parts land out of order or are written twice."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import zlib

import pytest

from diag.embedded import S3Server
from diag.storage import checks, landing
from diag.storage.landing import land, local_paths
from diag.storage import parse_url
from diag.storage.objectstore import MB, RemoteObject, TransferPlan, make_client
from tests.s3proxy import Proxy

MiB = 1 << 20


def b64crc(value: int, width: int = 4) -> str:
    return base64.b64encode(value.to_bytes(width, "big")).decode()


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


def client_for(server: S3Server, endpoint: str | None = None):
    return make_client(endpoint or server.endpoint_url, retries=1, credentials={
        "aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key,
        "region_name": server.region})


def leftovers(folder):
    return sorted(p.name for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def upload(server: S3Server, tmp_path, key: str, data: bytes, **extra) -> bytes:
    """boto3's own multipart upload (5 MiB parts): what a user's bucket holds."""
    from boto3.s3.transfer import TransferConfig

    source = tmp_path / f"{key.replace('/', '_')}.src"
    source.write_bytes(data)
    server.client().upload_file(str(source), "diag", key, ExtraArgs=extra or None,
                                Config=TransferConfig(multipart_threshold=5 * MiB,
                                                      multipart_chunksize=5 * MiB))
    return data


@pytest.mark.parametrize("how", ["ranged", "one GET"])
def test_composite_crc_multipart_object_with_one_flipped_byte_never_lands(s3, tmp_path,
                                                                          monkeypatch, how):
    # boto3's default multipart upload stores a COMPOSITE CRC32 (a CRC of the 3 part CRCs) and
    # a "-3" ETag: no MD5, no full-object CRC. botocore validates no composite checksum, on a
    # whole GET or a ranged one: diag cuts the bytes at the uploader's part bounds (5 MiB) and
    # checks the composite, also when its own download parts (4 MB) cut elsewhere.
    key = f"data/composite-{how.replace(' ', '')}.bin"
    data = upload(s3, tmp_path, key, os.urandom(12 * MiB))
    head = s3.client().head_object(Bucket="diag", Key=key, ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-3"') and head.get("ChecksumType") != "FULL_OBJECT"
    if how == "ranged":
        monkeypatch.setattr(landing, "transfer_plan",
                            lambda size, cores=None: TransferPlan(4 * MB, 4 * MB, 2))
    url, cache = f"s3://diag/{key}", tmp_path / "cache"
    final, manifest = local_paths(parse_url(url), cache)
    proxy = Proxy(s3.port, flip_at=3 * MB, flips=1000)  # one byte of every response
    try:
        with pytest.raises(RuntimeError, match=r"composite CRC32 of 3 parts .* in 3 downloads"):
            land(url, cache, client=client_for(s3, proxy.url))
    finally:
        proxy.close()
    assert proxy.flipped >= 3
    assert not final.exists() and not manifest.exists() and leftovers(cache) == []
    proxy = Proxy(s3.port, flip_at=3 * MB, flips=1)  # once: fetched again, lands whole
    try:
        got = land(url, cache, client=client_for(s3, proxy.url))
    finally:
        proxy.close()
    assert proxy.flipped == 1 and got.hit is False and final.read_bytes() == data
    entry = json.loads(manifest.read_text())["objects"][0]
    assert entry["checks"] == "size, CRC32 of each of 3 parts (composite)"
    assert entry["digest"] == f"crc32:{b64crc(zlib.crc32(data))}"  # what a hit re-checks


@pytest.mark.parametrize("algorithm", ["CRC32C", "CRC64NVME"])
def test_crc32c_and_crc64nvme_are_computed_and_checked(s3, tmp_path, monkeypatch, algorithm):
    # awscrt is in the storage extra: the checksums current SDKs store are checked, not skipped.
    # CRC64NVME (the default of new uploads) is full-object by S3's rule, here multipart;
    # CRC32C here single-part, fetched in ranged parts (moto computes a multipart CRC32C with
    # CRC32, unlike S3)
    key, data = f"data/{algorithm.lower()}.bin", os.urandom(11 * MiB)
    if algorithm == "CRC64NVME":
        upload(s3, tmp_path, key, data, ChecksumAlgorithm=algorithm)
    else:
        s3.client().put_object(Bucket="diag", Key=key, Body=data, ChecksumAlgorithm=algorithm)
    monkeypatch.setattr(landing, "transfer_plan",
                        lambda size, cores=None: TransferPlan(4 * MB, 4 * MB, 2))
    url, cache = f"s3://diag/{key}", tmp_path / "cache"
    proxy = Proxy(s3.port, flip_at=2 * MB, flips=1000)
    try:
        with pytest.raises(RuntimeError, match=rf"{algorithm} .* in 3 downloads"):
            land(url, cache, client=client_for(s3, proxy.url))
    finally:
        proxy.close()
    got = land(url, cache, client=client_for(s3))
    assert got.path.read_bytes() == data
    _, manifest = local_paths(parse_url(url), cache)
    assert json.loads(manifest.read_text())["objects"][0]["checks"] == (
        f"size, full-object {algorithm}" if algorithm == "CRC64NVME"
        else f"size, MD5 = ETag, full-object {algorithm}")


def test_a_short_object_never_lands_under_a_manifest_claiming_the_listed_size(s3, tmp_path,
                                                                              monkeypatch):
    # the listing said 1000 bytes more than the GET brought (an object replaced by a shorter one
    # between LIST and GET, a store that cut the body short): nothing lands, no manifest
    s3.client().put_object(Bucket="diag", Key="data/short.bin", Body=os.urandom(500_000))
    real = landing.list_s3

    def longer(client, url):
        return [RemoteObject(o.key, o.size + 1000, o.etag) for o in real(client, url)]

    monkeypatch.setattr(landing, "list_s3", longer)
    url = "s3://diag/data/short.bin"
    final, manifest = local_paths(parse_url(url), tmp_path)
    with pytest.raises(RuntimeError, match=r"landed 500000 bytes, the listing says 501000"):
        land(url, tmp_path, client=client_for(s3))
    assert not final.exists() and not manifest.exists() and leftovers(tmp_path) == []


def _stream_of(tmp_path, data: bytes, writes, want: checks.Expected):
    fd = os.open(tmp_path / "s.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    stream = checks.Stream(fd, want, len(data))
    for start, end in writes:
        stream.seek(start)
        stream.write(data[start:end])
    try:
        return stream.finish()
    finally:
        os.close(fd)


def test_streamed_hashes_equal_the_file_with_parts_out_of_order_and_rewritten(tmp_path):
    data = os.urandom(40 * MiB + 123)
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    want = checks.Expected(md5=hashlib.md5(data).hexdigest(), crc=("crc32", crc))
    bounds = list(range(0, len(data), 3 * MiB)) + [len(data)]
    parts = list(zip(bounds, bounds[1:]))
    random.Random(7).shuffle(parts)  # ranged parts land in any order
    chunks = [(s + k, min(s + k + 256 * 1024, e)) for s, e in parts for k in range(0, e - s,
                                                                                    256 * 1024)]
    for writes in (chunks, chunks + chunks[:40]):  # the second: a re-GET rewrites a part
        got = _stream_of(tmp_path, data, writes, want)
        assert got.md5.hexdigest() == want.md5
        assert got.verdict() == (f"crc32:{crc}", "size, full-object CRC32")
    bad = bytearray(data)
    bad[len(data) // 2] ^= 1
    with pytest.raises(checks.Mismatch, match="full-object CRC32"):
        _stream_of(tmp_path, bytes(bad), chunks, want).verdict()


def test_composite_of_uneven_parts_uses_the_part_sizes_given(tmp_path):
    sizes = (5 * MiB, 5 * MiB, 1234)
    data = os.urandom(sum(sizes))
    cuts = [0, sizes[0], sizes[0] + sizes[1], len(data)]
    part_crcs = b"".join(zlib.crc32(data[a:b]).to_bytes(4, "big") for a, b in zip(cuts, cuts[1:]))
    stored = base64.b64encode(zlib.crc32(part_crcs).to_bytes(4, "big")).decode() + "-3"
    want = checks.Expected(composite=("crc32", stored, sizes))
    writes = [(s, min(s + 1_000_000, len(data))) for s in range(0, len(data), 1_000_000)]
    random.Random(3).shuffle(writes)  # in any order, as ranged parts land
    assert _stream_of(tmp_path, data, writes, want).verdict()[1] == (
        "size, CRC32 of each of 3 parts (composite)")
    shifted = checks.Expected(composite=("crc32", stored, (4 * MiB, 6 * MiB, 1234)))
    with pytest.raises(checks.Mismatch, match="composite CRC32"):
        _stream_of(tmp_path, data, writes, shifted).verdict()


def test_aws_endpoint_url_is_honoured_for_a_source_and_noted_without_one(s3, tmp_path,
                                                                          monkeypatch):
    from diag.config import StorageConfig
    from diag.storage.experiment import open_source

    s3.client().put_object(Bucket="diag", Key="data/env.bin", Body=b"x" * 1000)
    for name, value in (("AWS_ENDPOINT_URL", s3.endpoint_url),
                        ("AWS_ACCESS_KEY_ID", s3.access_key),
                        ("AWS_SECRET_ACCESS_KEY", s3.secret_key),
                        ("AWS_DEFAULT_REGION", s3.region)):
        monkeypatch.setenv(name, value)
    cfg = StorageConfig.quick(source="s3://diag/data/env.bin", local_dir=str(tmp_path))
    with open_source(cfg) as (_, client, env):  # no --endpoint-url: boto3 reads the variable
        assert client.meta.endpoint_url == s3.endpoint_url
        assert land(cfg.source, tmp_path, client=client).bytes == 1000
    with pytest.warns(RuntimeWarning, match=r"AWS_ENDPOINT_URL=http://127\.0\.0\.1:\d+ is set, "
                                            r"but no --source was given"):
        with open_source(StorageConfig.quick(size_mb=1.0)) as (url, client, _):
            assert client.meta.endpoint_url != s3.endpoint_url  # the embedded one, as said


def test_hf_endpoint_without_a_model_is_noted(monkeypatch):
    from diag.config import ModelLoadConfig
    from diag.model_load.source import open_source

    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.internal")
    with pytest.warns(RuntimeWarning, match=r"HF_ENDPOINT=https://hub\.example\.internal is set, "
                                            r"but no --model was given"):
        with open_source(ModelLoadConfig.quick()) as src:
            assert src.endpoint.startswith("http://127.0.0.1:")


def test_a_composite_of_unequal_parts_is_checked_at_the_uploaders_bounds(s3, tmp_path):
    # an uploader that cut unequal parts (5 MiB, 6 MiB, 1 MiB): part 1's size does not tell the
    # rest, so a first mismatch asks for every part's size and checks again at those bounds
    client = s3.client()
    data = os.urandom(12 * MiB)
    cuts = [0, 5 * MiB, 11 * MiB, 12 * MiB]
    up = client.create_multipart_upload(Bucket="diag", Key="data/uneven.bin",
                                        ChecksumAlgorithm="CRC32")
    parts = []
    for n, (a, b) in enumerate(zip(cuts, cuts[1:]), start=1):
        got = client.upload_part(Bucket="diag", Key="data/uneven.bin", PartNumber=n,
                                 UploadId=up["UploadId"], Body=data[a:b], ChecksumAlgorithm="CRC32")
        parts.append({"PartNumber": n, "ETag": got["ETag"], "ChecksumCRC32": got["ChecksumCRC32"]})
    client.complete_multipart_upload(Bucket="diag", Key="data/uneven.bin", UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": parts})
    got = land("s3://diag/data/uneven.bin", tmp_path, client=client_for(s3))
    assert got.path.read_bytes() == data
    _, manifest = local_paths(parse_url("s3://diag/data/uneven.bin"), tmp_path)
    assert json.loads(manifest.read_text())["objects"][0]["checks"] == (
        "size, CRC32 of each of 3 parts (composite)")


def test_an_sse_kms_object_whose_etag_is_no_md5_is_checked_by_its_stored_crc(s3, tmp_path):
    # S3 gives an SSE-KMS object an ETag that is no MD5 of its bytes (moto keeps the MD5, so the
    # expectation is given a foreign one here): diag then asks the store for its checksum
    # (ChecksumMode=ENABLED) and checks the bytes against that, instead of a size check only
    data = os.urandom(300_000)
    s3.client().put_object(Bucket="diag", Key="data/kms.bin", Body=data,
                           ServerSideEncryption="aws:kms", ChecksumAlgorithm="CRC32")
    client = client_for(s3)
    etag = client.head_object(Bucket="diag", Key="data/kms.bin")["ETag"].strip('"')
    obj = RemoteObject("data/kms.bin", len(data), etag)
    want = checks.Expected(md5="0" * 32)  # what a one-GET object expects: its ETag as an MD5
    # one byte flipped (a byte set to 0 was no change when urandom had made it 0: 1 run in 256)
    flipped = data[:1000] + bytes([data[1000] ^ 0xFF]) + data[1001:]
    for body, ok in ((data, True), (flipped, False)):
        fd = os.open(tmp_path / f"{ok}.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            got = checks.Stream(fd, want, len(body))
            got.write(body)
            got.finish()
            if ok:
                assert landing._verdict(client, "diag", obj, got) == (
                    f"crc32:{b64crc(zlib.crc32(data))}",
                    "size, full-object CRC32 (SSE-KMS/SSE-C: the ETag is no MD5)")
            else:
                with pytest.raises(checks.Mismatch, match="full-object CRC32"):
                    landing._verdict(client, "diag", obj, got)
        finally:
            os.close(fd)
