"""land()'s checks on small files (diag.storage.checks), through its public faces: what a HEAD
answer is checked against, and a Stream written in any order, rewritten, cut at any part layout,
its verdict and MD5 (each mismatch said). The HEAD answers come from a stand-in store that returns
what S3 returns (the real-server path is tests/storage/test_storage_checks.py)."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import sys
import threading
import zlib

import pytest
from awscrt import checksums

from diag.storage import checks
from diag.storage.checks import Expected, Mismatch

CHECK = b"123456789"  # the CRC catalogue's check input
CHECK_VALUES = {"crc32": 0xCBF43926, "crc32c": 0xE3069283, "crc64nvme": 0xAE8B14860A799888}
FNS = {"crc32": zlib.crc32, "crc32c": checksums.crc32c, "crc64nvme": checksums.crc64nvme}


def b64(value: int, width: int = 4) -> str:
    return base64.b64encode(value.to_bytes(width, "big")).decode()


def crc_b64(data: bytes, name: str = "crc32") -> str:
    return b64(FNS[name](data), 8 if name == "crc64nvme" else 4)


def crc32_b64(data: bytes) -> str:
    return crc_b64(data)


def composite(data: bytes, sizes, name: str = "crc32", suffix: bool = True) -> str:
    width, cuts = 8 if name == "crc64nvme" else 4, [0]
    for s in sizes:
        cuts.append(cuts[-1] + s)
    parts = b"".join(FNS[name](data[a:b]).to_bytes(width, "big") for a, b in zip(cuts, cuts[1:]))
    return crc_b64(parts, name) + (f"-{len(sizes)}" if suffix else "")


def composite32(data: bytes, sizes, suffix: bool = True) -> str:
    return composite(data, sizes, "crc32", suffix)


def pieces(size: int, step: int, seed: int | None = None) -> list[tuple[int, int]]:
    """[start, end) writes of `step` bytes covering `size`, shuffled with a seed."""
    out = [(s, min(s + step, size)) for s in range(0, size, step)]
    if seed is not None:
        random.Random(seed).shuffle(out)
    return out


def streamed(tmp_path, data: bytes, writes, want: Expected, size: int | None = None):
    """A Stream over a new file, written as s3transfer writes (seek, write), finished."""
    fd = os.open(tmp_path / "s.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        stream = checks.Stream(fd, want, len(data) if size is None else size)
        for start, end in writes:
            assert stream.seek(start) == start and stream.tell() == start
            assert stream.write(data[start:end]) == end - start
        return stream.finish()
    finally:
        os.close(fd)


class Store:
    """HEAD answers as S3 gives them: the object's, and per part number (PartNumber=n)."""

    class meta:  # noqa: N801  the client's attribute
        endpoint_url = "http://user:secret@store.example:9000"

    def __init__(self, head: dict, parts: dict[int, dict] | None = None) -> None:
        self.answer, self.parts, self.calls = head, parts or {}, []

    def head_object(self, **kw):
        self.calls.append(kw)
        if "PartNumber" in kw:
            return self.parts[kw["PartNumber"]]
        return self.answer


# -- what to check against: the HEAD answers ---------------------------------------------------

def test_an_md5_etag_of_one_get_needs_no_head():
    store = Store({})
    assert checks.expected(store, "b", "k", 10, "ABCDEF", True, False) == Expected(md5="abcdef")
    assert store.calls == []


def test_an_etag_moved_since_the_listing_is_its_own_error_and_hides_the_password():
    store = Store({"ETag": '"other"'})
    with pytest.raises(RuntimeError) as err:
        checks.expected(store, "b", "k", 10, "abc", True, True)
    msg = str(err.value)
    assert msg.startswith("s3://b/k (endpoint ") and "secret" not in msg
    assert msg.endswith("the object changed while it was landing; run again")
    assert store.calls == [{"Bucket": "b", "Key": "k", "ChecksumMode": "ENABLED"}]
    assert checks.head(Store({"ETag": '"abc"', "x": 1}), "b", "k", "abc")["x"] == 1


def test_without_a_stored_crc_the_md5_is_all_unless_encrypted():
    assert checks.expected(Store({"ETag": '"AB"'}), "b", "k", 5, "AB", True, True) == Expected(
        md5="ab")
    assert checks.expected(Store({"ETag": "AB-2"}), "b", "k", 5, "AB-2", False, True) == Expected()
    kms = Store({"ETag": "ab", "ServerSideEncryption": "aws:kms:dsse"})
    assert checks.expected(kms, "b", "k", 5, "ab", True, True) == Expected(encrypted=True)
    ssec = Store({"ETag": "ab", "SSECustomerAlgorithm": "AES256"})
    assert checks.expected(ssec, "b", "k", 5, "ab", True, True) == Expected(encrypted=True)
    assert checks.encrypted({"ServerSideEncryption": "AES256"}) is False
    assert checks.encrypted({}) is False and checks.encrypted({"SSECustomerAlgorithm": ""}) is False


def test_a_full_object_crc_is_checked_whole():
    store = Store({"ETag": "ab", "ChecksumCRC32C": "c2M=", "ChecksumType": "FULL_OBJECT"})
    assert checks.expected(store, "b", "k", 5, "ab", True, True) == Expected(
        md5="ab", crc=("crc32c", "c2M="))
    both = Store({"ETag": "ab-2", "ChecksumCRC32": "MzI=", "ChecksumCRC64NVME": "NjQ=",
                  "ChecksumType": "FULL_OBJECT"})
    assert checks.expected(both, "b", "k", 5, "ab-2", False, True).crc == ("crc32", "MzI=")
    nvme = Store({"ETag": "ab-2", "ChecksumCRC64NVME": "NjQ="})  # no type: full-object only
    assert checks.expected(nvme, "b", "k", 5, "ab-2", False, True) == Expected(
        crc=("crc64nvme", "NjQ="))
    single = Store({"ETag": "ab", "ChecksumCRC32": "MzI="})  # one part, no type: whole
    assert checks.expected(single, "b", "k", 5, "ab", False, True).crc == ("crc32", "MzI=")
    assert checks.expected(Store({"ETag": "ab", "ChecksumCRC32": ""}), "b", "k", 5, "ab", False,
                           True) == Expected()
    kms = Store({"ETag": "ab", "ChecksumCRC32": "MzI=", "ServerSideEncryption": "aws:kms"})
    assert checks.expected(kms, "b", "k", 5, "ab", True, True) == Expected(
        crc=("crc32", "MzI="), encrypted=True)


@pytest.mark.parametrize("answer, etag", [
    ({"ChecksumType": "COMPOSITE", "ChecksumCRC32": "MzI="}, "ab"),
    ({"ChecksumCRC32": "MzI=-3"}, "ab"),  # the value says it
    ({"ChecksumCRC32": "MzI="}, "ab-3"),  # no type (moto): a multipart ETag
])
def test_a_composite_crc_is_checked_per_uploader_part(answer, etag):
    parts = {1: {"ContentLength": 4, "PartsCount": 3}}
    store = Store({"ETag": etag, "ServerSideEncryption": "aws:kms"} | answer, parts)
    got = checks.expected(store, "b", "k", 10, etag, False, True)
    assert got == Expected(composite=("crc32", answer["ChecksumCRC32"], (4, 4, 2)),
                           encrypted=True)
    assert store.calls[1] == {"Bucket": "b", "Key": "k", "PartNumber": 1}
    plain = Store({"ETag": "ab"} | answer, parts)  # not encrypted: the MD5 is checked too
    assert checks.expected(plain, "b", "k", 10, "ab", True, True).md5 == "ab"


def test_part_sizes_follow_from_part_one_unless_they_do_not_add_up():
    parts = {1: {"ContentLength": 4, "PartsCount": 3}, 2: {"ContentLength": 5},
             3: {"ContentLength": 1}}
    assert checks.part_sizes(Store({}, parts), "b", "k", 10) == (4, 4, 2)
    assert checks.part_sizes(Store({}, parts), "b", "k", 12) == (4, 4, 4)  # last == one
    store = Store({}, parts)
    assert checks.part_sizes(store, "b", "k", 10, every=True) == (4, 5, 1)
    assert store.calls == [{"Bucket": "b", "Key": "k", "PartNumber": n} for n in (1, 2, 3)]
    assert checks.part_sizes(Store({}, parts), "b", "k", 9) == (4, 4, 1)  # a 1-byte last part
    assert checks.part_sizes(Store({}, parts), "b", "k", 13) == (4, 5, 1)  # 5 > 4: asked
    assert checks.part_sizes(Store({}, parts), "b", "k", 8) == (4, 5, 1)  # 0 left: asked
    assert checks.part_sizes(Store({}, {1: {"ContentLength": 7}}), "b", "k", 7) == (7,)
    assert checks.part_sizes(Store({}, {1: {"ContentLength": 7, "PartsCount": None}}), "b", "k",
                             7) == (7,)


# -- the crcs, through a Stream's verdict ------------------------------------------------------

@pytest.mark.parametrize("name", ["crc32", "crc32c", "crc64nvme"])
def test_each_crc_gives_the_catalogue_check_value_in_any_order_of_writes(name, tmp_path):
    width = 8 if name == "crc64nvme" else 4
    want = Expected(crc=(name, b64(CHECK_VALUES[name], width)))
    got = streamed(tmp_path, CHECK, [(4, 9), (0, 4)], want)
    assert got.verdict() == (f"{name}:{b64(CHECK_VALUES[name], width)}",
                             f"size, full-object {name.upper()}")
    (tmp_path / "f").write_bytes(CHECK * 1000)
    assert checks.file_crc(tmp_path / "f", name) == crc_b64(CHECK * 1000, name)
    assert checks.CRCS == {"ChecksumCRC32": "crc32", "ChecksumCRC32C": "crc32c",
                           "ChecksumCRC64NVME": "crc64nvme"}


def test_file_crc_reads_a_file_larger_than_its_buffer(tmp_path):
    data = random.Random(1).randbytes((8 << 20) + 4097)
    (tmp_path / "big").write_bytes(data)
    assert checks.file_crc(tmp_path / "big", "crc32") == crc32_b64(data)
    (tmp_path / "empty").write_bytes(b"")
    assert checks.file_crc(tmp_path / "empty", "crc32") == b64(0)


@pytest.mark.parametrize("name", ["crc32", "crc32c", "crc64nvme"])
def test_a_composite_of_parts_written_out_of_order_is_checked_per_part(name, tmp_path):
    # 90-byte writes cross the parts' bounds in a shuffled order: each part's CRC is joined from
    # its runs, and the whole file's from the parts'
    data = random.Random(2).randbytes(1000)
    sizes = (300, 400, 300)
    want = Expected(composite=(name, composite(data, sizes, name), sizes))
    got = streamed(tmp_path, data, pieces(1000, 90, seed=3), want)
    assert got.verdict() == (f"{name}:{crc_b64(data, name)}",
                             f"size, {name.upper()} of each of 3 parts (composite)")
    bad = bytearray(data)
    bad[650] ^= 1
    with pytest.raises(Mismatch, match=f"composite {name.upper()} of 3 parts"):
        streamed(tmp_path, bytes(bad), pieces(1000, 90, seed=3), want).verdict()


def test_an_empty_object_and_an_untouched_file_are_hashed_whole(tmp_path):
    assert streamed(tmp_path, b"", [], Expected(md5=hashlib.md5(b"").hexdigest())).verdict() == (
        f"crc32:{b64(0)}", "size")
    data = random.Random(12).randbytes(3000)  # no write: the file as it is (land()'s re-check)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        sizes = (1000, 1000, 1000)
        got = checks.Stream(fd, Expected(md5="x", composite=("crc32", composite32(data, sizes),
                                                              sizes)), 3000).finish()
    finally:
        os.close(fd)
    assert got.verdict() == (f"crc32:{crc32_b64(data)}", "size, CRC32 of each of 3 parts "
                             "(composite)")
    assert got.md5.hexdigest() == hashlib.md5(data).hexdigest()


# -- the verdict: full-object, composite, none, without awscrt ----------------------------------

def test_a_full_object_crc_passes_or_names_both_values(tmp_path):
    data = bytes(range(256)) * 3
    want = Expected(md5=hashlib.md5(data).hexdigest(), crc=("crc32", crc32_b64(data)))
    good = streamed(tmp_path, data, pieces(len(data), 7), want)
    assert good.md5.hexdigest() == hashlib.md5(data).hexdigest()
    assert good.verdict() == (f"crc32:{crc32_b64(data)}", "size, full-object CRC32")
    bad = streamed(tmp_path, data, pieces(len(data), 7), Expected(crc=("crc32",
                                                                       crc32_b64(data[1:]))))
    with pytest.raises(Mismatch) as err:
        bad.verdict()
    assert str(err.value) == (f"full-object CRC32 {crc32_b64(data)}, the store has "
                              f"{crc32_b64(data[1:])}")
    assert streamed(tmp_path, data, [(0, len(data))], Expected()).md5 is None


def test_only_the_size_is_checked_without_a_stored_crc(tmp_path):
    data = b"abc" * 10
    got = streamed(tmp_path, data, pieces(30, 7), Expected(md5="x"))
    assert got.verdict() == (f"crc32:{crc32_b64(data)}", "size")  # MD5: the caller's


@pytest.mark.parametrize("step", [1, 3, 4, 100])
def test_a_composite_crc_is_cut_at_each_parts_bounds(tmp_path, step):
    data = bytes(range(250)) * 4
    sizes = (400, 400, 200)
    want = Expected(composite=("crc32", composite32(data, sizes), sizes))
    assert streamed(tmp_path, data, pieces(1000, step), want).verdict() == (
        f"crc32:{crc32_b64(data)}", "size, CRC32 of each of 3 parts (composite)")
    bare = Expected(composite=("crc32", composite32(data, sizes, False), sizes))
    assert streamed(tmp_path, data, pieces(1000, step), bare).verdict()[1].endswith(
        "(composite)")  # a store that omits "-N"


def test_a_composite_mismatch_names_the_parts_and_both_values(tmp_path):
    data = bytes(range(250)) * 4
    stored = composite32(data, (500, 500))
    got = streamed(tmp_path, data, pieces(1000, 7), Expected(composite=("crc32", stored,
                                                                        (400, 600))))
    with pytest.raises(Mismatch) as err:
        got.verdict()
    assert str(err.value) == (f"composite CRC32 of 2 parts {composite32(data, (400, 600))}, the "
                              f"store has {stored}")
    wrong_count = composite32(data, (400, 600)).split("-")[0] + "-3"
    with pytest.raises(Mismatch):
        streamed(tmp_path, data, [(0, 1000)], Expected(composite=("crc32", wrong_count,
                                                                  (400, 600)))).verdict()
    short = Expected(composite=("crc32", stored, (500, 600)))  # parts longer than the file
    with pytest.raises(Mismatch):
        streamed(tmp_path, data, [(0, 1000)], short).verdict()


def test_bytes_past_the_last_part_are_left_to_the_size_check(tmp_path):
    data = bytes(range(100))
    want = Expected(composite=("crc32", composite32(data[:90], (40, 50)), (40, 50)))
    assert streamed(tmp_path, data, pieces(100, 30), want, size=90).verdict()[1] == (
        "size, CRC32 of each of 2 parts (composite)")


@pytest.mark.parametrize("order", [None, 5])
def test_without_awscrt_crc32_is_still_joined_and_the_others_noted_unchecked(tmp_path,
                                                                             monkeypatch, order):
    monkeypatch.setitem(sys.modules, "awscrt", None)  # import awscrt raises ImportError
    data = random.Random(13).randbytes(5000)
    sizes = (2000, 2000, 1000)
    want = Expected(composite=("crc32", composite32(data, sizes), sizes))
    assert streamed(tmp_path, data, pieces(5000, 300, order), want).verdict() == (
        f"crc32:{crc32_b64(data)}", "size, CRC32 of each of 3 parts (composite)")
    got = streamed(tmp_path, data, pieces(5000, 300, order), Expected(crc=("crc32c", "x")))
    assert got.verdict() == (f"crc32:{crc32_b64(data)}",
                             "size (crc32c stored, not checked: pip install awscrt)")
    comp = Expected(composite=("crc64nvme", "v", (5000,)))
    assert streamed(tmp_path, data, [(0, 5000)], comp).verdict()[1] == (
        "size (crc64nvme stored, not checked: pip install awscrt)")


# -- the stream: positioned writes, out of order, rewritten ------------------------------------

def reads_of(monkeypatch) -> list[int]:
    """The lengths of the Stream's read-backs from here on."""
    reads, real = [], os.preadv
    monkeypatch.setattr(checks.os, "preadv", lambda fd, bufs, at: reads.append(
        len(bufs[0])) or real(fd, bufs, at))
    return reads


def test_streamed_hashes_equal_the_files_in_any_order_and_after_a_rewrite(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "_CHUNK", 256)  # the follower reads back as the prefix grows
    monkeypatch.setattr(checks, "_SYNC", 1000)
    data = random.Random(4).randbytes(10_000)
    want = Expected(md5=hashlib.md5(data).hexdigest(), crc=("crc32", crc32_b64(data)))
    writes, shuffled = pieces(10_000, 300), pieces(10_000, 300, seed=5)
    for order in (writes, shuffled, shuffled + shuffled[:5]):
        got = streamed(tmp_path, data, order, want)
        assert got.md5.hexdigest() == want.md5  # never read past what was written
        assert got.verdict() == (f"crc32:{crc32_b64(data)}", "size, full-object CRC32")
    bad = bytearray(data)
    bad[5000] ^= 1
    with pytest.raises(Mismatch, match="full-object CRC32"):
        streamed(tmp_path, bytes(bad), shuffled, want).verdict()


@pytest.mark.parametrize("first, then, ok", [("bad", "good", True), ("good", "bad", False)])
def test_a_rewritten_range_is_checked_as_it_ends_up(tmp_path, first, then, ok):
    # a re-GET rewrites a part: the CRCs streamed on the first bytes are stale, the file decides
    data = random.Random(14).randbytes(3000)
    bad = bytearray(data)
    bad[1500] ^= 1
    body = {"good": data, "bad": bytes(bad)}
    sizes = (1000, 1000, 1000)
    want = Expected(composite=("crc32", composite32(data, sizes), sizes))
    fd = os.open(tmp_path / "r.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        stream = checks.Stream(fd, want, 3000)
        for source, (start, end) in [(body[first], (0, 3000)), (body[then], (1200, 1800))]:
            stream.seek(start)
            stream.write(source[start:end])
        got = stream.finish()
    finally:
        os.close(fd)
    if ok:
        assert got.verdict()[1] == "size, CRC32 of each of 3 parts (composite)"
    else:
        with pytest.raises(Mismatch, match="composite CRC32"):
            got.verdict()


@pytest.mark.parametrize("writes, reread", [
    ([(10, 20), (30, 40), (0, 5), (5, 10), (20, 30), (50, 60), (45, 50), (40, 45)], False),
    ([(0, 5), (10, 20), (10, 10), (5, 10), (20, 60)], False),  # an empty write rewrites nothing
    ([(0, 40), (35, 41), (41, 60)], True),  # over the end of a run
    ([(10, 20), (5, 11), (0, 5), (20, 60)], True),  # over the start of the next
    ([(0, 10), (20, 30), (12, 40), (10, 12), (40, 60)], True),  # over a whole run
])
def test_touching_writes_are_never_read_back_and_overlapping_ones_are(tmp_path, monkeypatch,
                                                                      writes, reread):
    data = random.Random(15).randbytes(60)
    reads = reads_of(monkeypatch)
    want = Expected(crc=("crc32", crc32_b64(data)))
    assert streamed(tmp_path, data, writes, want).verdict()[1] == "size, full-object CRC32"
    assert bool(reads) is reread


@pytest.mark.parametrize("piece", [1000, 700])
def test_parts_written_up_to_and_across_their_bounds_are_not_read_back(tmp_path, monkeypatch,
                                                                       piece):
    # the writer's runs are cut at each part's bound; a run carried past one made the parts' CRCs
    # unknown, and finish() read the whole file back a second time
    reads = reads_of(monkeypatch)
    sizes = (4000, 4000, 123)
    data = random.Random(8).randbytes(sum(sizes))
    want = Expected(composite=("crc32", composite32(data, sizes), sizes))
    got = streamed(tmp_path, data, pieces(len(data), piece), want)
    assert got.verdict() == (f"crc32:{crc32_b64(data)}", "size, CRC32 of each of 3 parts "
                             "(composite)")
    assert reads == []


def test_a_gap_left_by_the_writer_is_hashed_from_the_file(tmp_path):
    data = bytes(range(200)) * 5
    fd = os.open(tmp_path / "g.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        os.pwrite(fd, data[:100], 0)  # written outside the stream: the runs do not tile
        stream = checks.Stream(fd, Expected(crc=("crc32", crc32_b64(data))), len(data))
        stream.seek(100)
        stream.write(data[100:])
        assert stream.finish().verdict()[1] == "size, full-object CRC32"
    finally:
        os.close(fd)


def test_the_sink_finishes_a_short_write_at_the_right_offset(tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(checks.os, "pwrite", lambda fd, view, at: real(fd, view[:300], at))
    data = random.Random(10).randbytes(1000)
    want = Expected(md5=hashlib.md5(data).hexdigest(), crc=("crc32", crc32_b64(data)))
    got = streamed(tmp_path, data, [(0, 1000)], want)
    assert (tmp_path / "s.bin").read_bytes() == data
    assert got.verdict()[1] == "size, full-object CRC32" and got.md5.hexdigest() == want.md5


# -- the follower: reads back whole chunks during the download, writes back early --------------

def test_the_follower_reads_each_whole_chunk_before_the_download_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "_CHUNK", 256)
    reads, real, read = [], os.preadv, threading.Event()

    def spy(fd, bufs, at):
        reads.append((at, len(bufs[0])))
        read.set()
        return real(fd, bufs, at)

    monkeypatch.setattr(checks.os, "preadv", spy)
    data = random.Random(9).randbytes(1000)
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        stream = checks.Stream(fd, Expected(md5=hashlib.md5(data).hexdigest()), 1000)
        stream.write(data[:200])  # under a chunk: not read yet
        stream.seek(600)
        stream.write(data[600:])  # past a hole: not the prefix
        stream.seek(200)
        stream.write(data[200:256])  # exactly one chunk from 0
        assert read.wait(10)
        stream.write(data[256:600])
        got = stream.finish()
    finally:
        os.close(fd)
    assert reads[0] == (0, 256) and got.md5.hexdigest() == hashlib.md5(data).hexdigest()
    followed = reads[: reads.index((0, 256)) + 1]
    assert all(n == 256 for _, n in followed)  # whole chunks while following, the tail in finish


def test_the_follower_writes_back_early_once_per_due_amount_and_its_error_reaches_finish(
        tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "_SYNC", 100)
    synced, done, real = [], threading.Event(), os.fdatasync

    def sync(fd):
        real(fd)
        synced.append(fd)
        done.set()

    monkeypatch.setattr(checks.os, "fdatasync", sync)
    data = bytes(range(250)) * 4
    fd = os.open(tmp_path / "y.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        s = checks.Stream(fd, Expected(md5=hashlib.md5(data).hexdigest()), len(data))
        s.write(data[:99])
        s.seek(500, 0)
        s.write(data[500:501])  # 100 bytes written in all: due
        assert done.wait(10)  # the follower synced before the download ended
        done.clear()
        s.seek(-402, 1)
        assert s.tell() == 99
        s.write(data[99:150])  # 51 since the write-back: not due again
        assert not done.wait(0.5)
        s.write(data[150:500])
        s.seek(501)
        s.write(data[501:])
        h = s.finish()
        assert set(synced) == {fd} and h.md5.hexdigest() == hashlib.md5(data).hexdigest()
        assert s.seekable() is True and s.tell() == 1000
    finally:
        os.close(fd)

    failed = threading.Event()

    def broken(fd):
        failed.set()
        raise OSError("disk gone")

    monkeypatch.setattr(checks.os, "fdatasync", broken)
    fd = os.open(tmp_path / "z.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        s = checks.Stream(fd, Expected(), len(data))
        s.write(data)
        assert failed.wait(10)
        with pytest.raises(OSError, match="disk gone"):
            s.finish()
    finally:
        os.close(fd)


def test_an_abandoned_download_leaves_no_thread_that_blocks_exit(tmp_path):
    before = set(threading.enumerate())
    fd = os.open(tmp_path / "a.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        s = checks.Stream(fd, Expected(md5="x"), 10)
        started = set(threading.enumerate()) - before
        assert started and all(t.daemon for t in started)  # daemons: exit never waits on them
        s.write(b"x" * 5)
        s.abandon()
        assert not any(t.is_alive() for t in started)
    finally:
        os.close(fd)


def test_md5_is_asked_for_as_a_non_security_use(tmp_path, monkeypatch):
    # a FIPS-restricted OpenSSL refuses MD5 unless it is flagged usedforsecurity=False
    real = hashlib.md5

    def fips_md5(*args, usedforsecurity=True):
        if usedforsecurity is not False:
            raise ValueError("[digital envelope routines] unsupported")
        return real(*args, usedforsecurity=False)

    monkeypatch.setattr(checks.hashlib, "md5", fips_md5)
    data = b"abc" * 10
    assert streamed(tmp_path, data, [(0, 30)], Expected(md5="x")).md5.hexdigest() == real(
        data).hexdigest()
