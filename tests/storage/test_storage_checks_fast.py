"""land()'s checks on bytes in memory and small files (diag.storage.checks):
what a HEAD answer is checked against, the CRCs (composite per part, full-object), the streamed
hashes with writes out of order or rewritten, and each mismatch said. The HEAD answers come from
a stand-in store that returns what S3 returns (the real-server path is
tests/storage/test_storage_checks.py, too slow to run per mutant)."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import zlib

import pytest

from diag.storage import checks, landing
from diag.storage.checks import Expected, Mismatch

CHECK = b"123456789"  # the CRC catalogue's check input
CHECK_VALUES = {"crc32": 0xCBF43926, "crc32c": 0xE3069283, "crc64nvme": 0xAE8B14860A799888}


def b64(value: int, width: int = 4) -> str:
    return base64.b64encode(value.to_bytes(width, "big")).decode()


def crc32_b64(data: bytes) -> str:
    return b64(zlib.crc32(data))


def composite32(data: bytes, sizes, suffix: bool = True) -> str:
    cuts = [0]
    for s in sizes:
        cuts.append(cuts[-1] + s)
    parts = b"".join(zlib.crc32(data[a:b]).to_bytes(4, "big") for a, b in zip(cuts, cuts[1:]))
    return crc32_b64(parts) + (f"-{len(sizes)}" if suffix else "")


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


# -- crc ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["crc32", "crc32c", "crc64nvme"])
def test_each_crc_gives_the_catalogue_check_value_in_any_number_of_updates(name, tmp_path):
    c = checks.Crc(name)
    c.update(CHECK[:4])
    c.update(memoryview(CHECK)[4:])
    width = 8 if name == "crc64nvme" else 4
    assert (c.name, c.value, c.width) == (name, CHECK_VALUES[name], width)
    assert c.digest() == CHECK_VALUES[name].to_bytes(width, "big")
    assert c.b64() == b64(CHECK_VALUES[name], width)
    path = tmp_path / "f"
    path.write_bytes(CHECK * 1000)
    whole = checks.Crc(name)
    whole.update(CHECK * 1000)
    assert landing.file_crc(path, name) == whole.b64()
    assert checks.CRCS == {"ChecksumCRC32": "crc32", "ChecksumCRC32C": "crc32c",
                        "ChecksumCRC64NVME": "crc64nvme"}


def test_file_crc_reads_a_file_larger_than_its_buffer(tmp_path):
    data = random.Random(1).randbytes((8 << 20) + 4097)
    (tmp_path / "big").write_bytes(data)
    assert landing.file_crc(tmp_path / "big", "crc32") == crc32_b64(data)
    (tmp_path / "empty").write_bytes(b"")
    assert landing.file_crc(tmp_path / "empty", "crc32") == b64(0)


@pytest.mark.parametrize("name", ["crc32", "crc32c", "crc64nvme"])
def test_runs_join_bytes_written_out_of_order_per_segment(name):
    data = random.Random(2).randbytes(1000)
    bounds = [300, 700, 1000]
    runs = checks.Runs(name, bounds)
    pieces = [(s, min(s + 90, 1000)) for s in range(0, 1000, 90)]
    random.Random(3).shuffle(pieces)
    for s, e in pieces:
        runs.add(s, memoryview(data)[s:e])
    fn = checks.Crc(name)._fn
    assert runs.segments() == [fn(data[0:300], 0), fn(data[300:700], 0), fn(data[700:1000], 0)]
    runs.add(1000, memoryview(b"past the end"))  # refused by the size check, not counted here
    assert runs.segments()[-1] == fn(data[700:1000], 0)


def test_runs_with_a_gap_or_a_run_past_a_bound_give_no_segments():
    data = bytes(range(100))
    runs = checks.Runs("crc32", [50, 100])
    runs.add(0, memoryview(data)[:40])
    runs.add(60, memoryview(data)[60:])
    assert runs.segments() is None  # 40..60 never written
    runs.add(40, memoryview(data)[40:60])
    assert runs.segments() == [zlib.crc32(data[:50]), zlib.crc32(data[50:])]
    empty = checks.Runs("crc32", [0, 10])
    empty.add(0, memoryview(data)[:10])
    assert empty.segments() == [0, zlib.crc32(data[:10])]
    assert checks.Runs("crc32", [10]).segments() is None


def test_a_run_is_cut_at_each_bound_and_joined_within_a_segment():
    data = bytes(range(200))
    runs = checks.Runs("crc32", [100, 200])
    runs.add(0, memoryview(data)[:150])  # spans the bound: two runs
    assert sorted(runs.runs) == [0, 100]
    assert runs.runs[0] == [100, zlib.crc32(data[:100])]
    runs.add(150, memoryview(data)[150:])  # continues the run that ended at 150
    assert runs.runs[100] == [200, zlib.crc32(data[100:])] and 150 not in runs.runs
    assert runs.ends == {200: 100}  # the run that ended at 100 is not continued past it


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


def test_the_whole_files_crc_is_the_stores_algorithm_else_crc32():
    assert checks.whole_name(Expected(crc=("crc64nvme", "x"))) == "crc64nvme"
    assert checks.whole_name(Expected(composite=("crc32c", "x", (1,)))) == "crc32c"
    assert checks.whole_name(Expected(md5="ab")) == "crc32"


# -- the hashes, fed in file order -------------------------------------------------------------

def _hashed(want: Expected, data: bytes, step: int = 7) -> checks._Hashes:
    h = checks._Hashes(want)
    for at in range(0, len(data), step):
        h.update(memoryview(data)[at:at + step])
    return h


def test_a_full_object_crc_passes_or_names_both_values():
    data = bytes(range(256)) * 3
    good = _hashed(Expected(md5=hashlib.md5(data).hexdigest(), crc=("crc32", crc32_b64(data))),
                   data)
    assert good.pos == len(data) and good.md5.hexdigest() == hashlib.md5(data).hexdigest()
    assert good.verdict() == (f"crc32:{crc32_b64(data)}", "size, full-object CRC32")
    assert good.digest() == f"crc32:{crc32_b64(data)}"
    bad = _hashed(Expected(crc=("crc32", crc32_b64(data[1:]))), data)
    with pytest.raises(Mismatch) as err:
        bad.verdict()
    assert str(err.value) == (f"full-object CRC32 {crc32_b64(data)}, the store has "
                              f"{crc32_b64(data[1:])}")
    assert _hashed(Expected(), data).md5 is None


def test_only_the_size_is_checked_without_a_stored_crc():
    data = b"abc" * 10
    h = _hashed(Expected(md5="x"), data)
    assert h.verdict() == (f"crc32:{crc32_b64(data)}", "size")  # MD5: the caller's
    assert h.crc is None and h.parts is None


@pytest.mark.parametrize("step", [1, 3, 4, 100])
def test_a_composite_crc_is_cut_at_each_parts_bounds(step):
    data = bytes(range(250)) * 4
    sizes = (400, 400, 200)
    h = _hashed(Expected(composite=("crc32", composite32(data, sizes), sizes)), data, step)
    assert h.parts == [zlib.crc32(data[a:b]).to_bytes(4, "big")
                       for a, b in ((0, 400), (400, 800), (800, 1000))]
    assert h.composite() == composite32(data, sizes)
    assert h.verdict() == (f"crc32:{crc32_b64(data)}", "size, CRC32 of each of 3 parts "
                           "(composite)")
    bare = _hashed(Expected(composite=("crc32", composite32(data, sizes, False), sizes)), data)
    assert bare.verdict()[1].endswith("(composite)")  # a store that omits "-N"


def test_a_composite_mismatch_names_the_parts_and_both_values():
    data = bytes(range(250)) * 4
    stored = composite32(data, (500, 500))
    h = _hashed(Expected(composite=("crc32", stored, (400, 600))), data)
    with pytest.raises(Mismatch) as err:
        h.verdict()
    assert str(err.value) == (f"composite CRC32 of 2 parts {composite32(data, (400, 600))}, the "
                              f"store has {stored}")
    wrong_count = composite32(data, (400, 600)).split("-")[0] + "-3"
    with pytest.raises(Mismatch):
        _hashed(Expected(composite=("crc32", wrong_count, (400, 600))), data).verdict()


def test_bytes_past_the_last_part_are_left_to_the_size_check():
    data = bytes(range(100))
    h = _hashed(Expected(composite=("crc32", "x", (40, 50))), data, 30)
    assert h.parts == [zlib.crc32(data[:40]).to_bytes(4, "big"),
                       zlib.crc32(data[40:90]).to_bytes(4, "big")]
    assert h.pos == 100


def test_a_crc_awscrt_would_compute_is_noted_unchecked_without_it(monkeypatch):
    real = checks.Crc

    def no_awscrt(name):
        if name != "crc32":
            raise ImportError("awscrt")
        return real(name)

    monkeypatch.setattr(checks, "Crc", no_awscrt)
    data = b"xyz" * 5
    h = _hashed(Expected(crc=("crc32c", "whatever")), data)
    assert h.crc is None and h.whole.name == "crc32"
    assert h.verdict() == (f"crc32:{crc32_b64(data)}",
                           "size (crc32c stored, not checked: pip install awscrt)")
    comp = _hashed(Expected(composite=("crc64nvme", "v", (15,))), data)
    assert comp.parts is None and comp.note.startswith("crc64nvme stored, not checked")


def test_the_writers_crcs_make_the_whole_files_and_each_parts():
    data = bytes(range(256)) * 4
    sizes = (300, 300, 424)
    runs = checks.Runs("crc32", [300, 600, 1024])
    runs.add(0, memoryview(data))
    h = checks._Hashes(Expected(composite=("crc32", composite32(data, sizes), sizes)),
                       crcs=False)
    h.update(memoryview(data))
    assert h.whole.value == 0 and h.parts == []  # the writer computes them
    h.set_crcs(runs)
    assert h.whole.value == zlib.crc32(data)
    assert h.verdict()[0] == f"crc32:{crc32_b64(data)}"
    full = checks._Hashes(Expected(crc=("crc32", crc32_b64(data))), crcs=False)
    full.set_crcs(runs)
    assert full.parts is None and full.verdict()[1] == "size, full-object CRC32"


# -- the stream: positioned writes, out of order, rewritten ------------------------------------

@pytest.fixture
def fd(tmp_path):
    """A file open for reading and writing, as land() opens its partial file; closed after."""
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    yield fd
    os.close(fd)


def _stream(tmp_path, data: bytes, writes, want: Expected, inline: bool = True):
    fd = os.open(tmp_path / "s.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    stream = checks.Stream(fd, want, len(data) if inline else 0)
    assert (stream._inline is not None) == inline
    for start, end in writes:
        assert stream.sink.seek(start) == start and stream.sink.tell() == start
        assert stream.sink.write(data[start:end]) == end - start
    try:
        return stream.finish()
    finally:
        os.close(fd)


@pytest.mark.parametrize("inline", [True, False])
def test_streamed_hashes_equal_the_files_in_any_order_and_after_a_rewrite(tmp_path, monkeypatch,
                                                                         inline):
    monkeypatch.setattr(checks, "_CHUNK", 256)  # the follower reads back as the prefix grows
    monkeypatch.setattr(checks, "_SYNC", 1000)
    data = random.Random(4).randbytes(10_000)
    want = Expected(md5=hashlib.md5(data).hexdigest(), crc=("crc32", crc32_b64(data)))
    writes = [(s, min(s + 300, len(data))) for s in range(0, len(data), 300)]
    shuffled = writes[:]
    random.Random(5).shuffle(shuffled)
    for order in (writes, shuffled, shuffled + shuffled[:5]):
        got = _stream(tmp_path, data, order, want, inline)
        assert got.pos == len(data) and got.md5.hexdigest() == want.md5
        assert got.verdict() == (f"crc32:{crc32_b64(data)}", "size, full-object CRC32")
    bad = bytearray(data)
    bad[5000] ^= 1
    with pytest.raises(Mismatch, match="full-object CRC32"):
        _stream(tmp_path, bytes(bad), shuffled, want, inline).verdict()


@pytest.mark.parametrize("inline", [True, False])
def test_a_streamed_composite_uses_the_part_sizes_given(tmp_path, inline):
    sizes = (4000, 4000, 123)
    data = random.Random(6).randbytes(sum(sizes))
    want = Expected(composite=("crc32", composite32(data, sizes), sizes))
    writes = [(s, min(s + 1000, len(data))) for s in range(0, len(data), 1000)]
    random.Random(7).shuffle(writes)
    assert _stream(tmp_path, data, writes, want, inline).verdict()[1] == (
        "size, CRC32 of each of 3 parts (composite)")
    with pytest.raises(Mismatch, match="composite CRC32"):
        _stream(tmp_path, data, writes, Expected(composite=("crc32", want.composite[1],
                                                            (3000, 5000, 123))), inline).verdict()


@pytest.mark.parametrize("piece", [1000, 700])
def test_parts_written_up_to_and_across_their_bounds_are_not_read_back(tmp_path, monkeypatch,
                                                                       piece):
    # the writer's runs are cut at each part's bound; a run carried past one made segments()
    # give up, and finish() read the whole file back a second time
    reads = []
    real = os.preadv
    monkeypatch.setattr(checks.os, "preadv", lambda *a: reads.append(a) or real(*a))
    sizes = (4000, 4000, 123)
    data = random.Random(8).randbytes(sum(sizes))
    want = Expected(composite=("crc32", composite32(data, sizes), sizes))
    writes = [(s, min(s + piece, len(data))) for s in range(0, len(data), piece)]
    got = _stream(tmp_path, data, writes, want)
    assert got.verdict() == (f"crc32:{crc32_b64(data)}", "size, CRC32 of each of 3 parts "
                             "(composite)")
    assert reads == [] and got.pos == len(data)


def test_a_gap_left_by_the_writer_is_hashed_from_the_file(fd):
    data = bytes(range(200)) * 5
    want = Expected(crc=("crc32", crc32_b64(data)))
    os.pwrite(fd, data[:100], 0)  # written outside the sink: the runs do not tile
    stream = checks.Stream(fd, want, len(data))
    stream.sink.seek(100)
    stream.sink.write(data[100:])
    assert stream.finish().verdict()[1] == "size, full-object CRC32"


def test_spans_merge_and_a_rewrite_is_noticed(fd):
    s = checks.Stream(fd, Expected())
    for start, end in ((10, 20), (30, 40), (0, 5)):
        s.wrote(start, end)
    assert s._spans == [[0, 5], [10, 20], [30, 40]] and s._prefix() == 5
    s.wrote(5, 10)  # touching on both sides: one span, no overlap
    assert s._spans == [[0, 20], [30, 40]] and not s._overlap and s._prefix() == 20
    s.wrote(20, 30)
    assert s._spans == [[0, 40]] and not s._overlap and s._written == 40
    s.wrote(50, 60)
    s.wrote(45, 50)
    assert s._spans == [[0, 40], [45, 60]] and not s._overlap
    s.wrote(35, 41)  # over the end of a span
    assert s._overlap and s._spans == [[0, 41], [45, 60]]
    s.abandon()
    t = checks.Stream(fd, Expected())
    t.wrote(10, 20)
    t.wrote(5, 11)  # over the start of the next span
    assert t._overlap and t._spans == [[5, 20]] and t._prefix() == 0
    t.wrote(0, 30)  # over everything
    assert t._spans == [[0, 30]]
    t.abandon()
    idle = checks.Stream(fd, Expected())
    idle.abandon()  # nothing written, nothing overlapping: the follower still stops
    assert not idle._thread.is_alive()
    u = checks.Stream(fd, Expected())
    u.wrote(0, 10)
    u.wrote(20, 30)
    u.wrote(12, 40)
    assert u._overlap and u._spans == [[0, 10], [12, 40]]
    u.abandon()


def test_the_follower_writes_back_early_and_its_error_reaches_finish(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(checks, "_SYNC", 100)
    synced, done = [], threading.Event()
    real = os.fdatasync

    def sync(fd):
        real(fd)
        synced.append(fd)
        done.set()

    monkeypatch.setattr(checks.os, "fdatasync", sync)
    data = bytes(range(250)) * 4
    fd = os.open(tmp_path / "y.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        s = checks.Stream(fd, Expected(md5=hashlib.md5(data).hexdigest()), len(data))
        s.sink.seek(0)
        s.sink.write(data[:50])
        assert not done.is_set()  # 50 bytes: under _SYNC
        s.sink.seek(500, 0)
        s.sink.write(data[500:])
        s.sink.seek(-950, 1)
        assert s.sink.tell() == 50
        s.sink.write(data[50:500])
        assert done.wait(10)  # the follower synced before the download ended
        h = s.finish()
        assert set(synced) == {fd} and h.md5.hexdigest() == hashlib.md5(data).hexdigest()
        assert s.sink.seekable() is True and s.sink.tell() == 500
    finally:
        os.close(fd)

    def broken(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(checks.os, "fdatasync", broken)
    fd = os.open(tmp_path / "z.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        s = checks.Stream(fd, Expected(), len(data))
        s.sink.write(data)
        s._thread.join(10)  # the follower stops at its error
        with pytest.raises(OSError, match="disk gone"):
            s.finish()
    finally:
        os.close(fd)


# -- found by the mutants: the follower's reads, short writes, the default size ----------------

def test_the_follower_is_a_daemon_so_an_abandoned_download_never_blocks_exit(fd):
    s = checks.Stream(fd, Expected())
    assert s._thread.daemon is True
    s.abandon()


def test_read_hashes_the_prefix_exactly_up_to_its_end(fd, monkeypatch):
    monkeypatch.setattr(checks, "_CHUNK", 256)
    data = random.Random(9).randbytes(1000)
    os.pwrite(fd, data[:300], 0)
    os.pwrite(fd, data[600:], 600)  # a hole at 300..600: not yet written
    s = checks.Stream(fd, Expected(md5="x"))
    s.abandon()  # the follower stopped: _read is driven here alone
    buf = bytearray(256)
    s._read(buf, 300)  # 256 bytes, then the 44 up to the prefix's end, none past it
    assert s.hashes.pos == 300
    assert s.hashes.md5.hexdigest() == hashlib.md5(data[:300]).hexdigest()
    os.pwrite(fd, data[300:600], 300)
    s._read(buf, 1000)
    s._read(buf, 1001)  # one byte past the end of the file: stops there
    assert s.hashes.pos == 1000
    assert s.hashes.md5.hexdigest() == hashlib.md5(data).hexdigest()
    t = checks.Stream(fd, Expected(md5="x"))
    t.abandon()
    t._read(buf, 257)  # a last read of one byte is hashed too
    assert t.hashes.pos == 257
    assert t.hashes.md5.hexdigest() == hashlib.md5(data[:257]).hexdigest()


def test_the_sink_finishes_a_short_write_at_the_right_offset(tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(checks.os, "pwrite", lambda fd, view, at: real(fd, view[:300], at))
    data = random.Random(10).randbytes(1000)
    want = Expected(md5=hashlib.md5(data).hexdigest(), crc=("crc32", crc32_b64(data)))
    got = _stream(tmp_path, data, [(0, 1000)], want)
    assert (tmp_path / "s.bin").read_bytes() == data
    assert got.verdict()[1] == "size, full-object CRC32" and got.md5.hexdigest() == want.md5


def test_a_stream_without_a_size_computes_every_hash_itself(fd):
    data = random.Random(11).randbytes(1000)
    want = Expected(crc=("crc32", crc32_b64(data)))
    s = checks.Stream(fd, want)
    assert s._inline is None and s.hashes.crcs
    s.sink.seek(0)
    s.sink.write(data)
    assert s.finish().verdict() == (f"crc32:{crc32_b64(data)}", "size, full-object CRC32")


def test_an_empty_write_at_a_spans_start_is_no_rewrite(fd):
    # a zero-byte write rewrites nothing: no reason for finish() to hash the file again
    s = checks.Stream(fd, Expected())
    s.wrote(0, 5)
    s.wrote(10, 20)
    s.wrote(10, 10)
    assert not s._overlap and s._spans == [[0, 5], [10, 20]]
    s.abandon()


class _Stop(Exception):
    pass


class _Looks:
    """A Condition stand-in for driving Stream._follow in this thread: each wait_for records
    what the follower's wake-up rule says, lets it go on `passes` times, then stops it."""

    def __init__(self, passes: int = 0) -> None:
        self.said, self.passes = [], passes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_for(self, predicate):
        self.said.append(bool(predicate()))
        if len(self.said) > self.passes:
            raise _Stop
        return True


def _driven(tmp_path, monkeypatch, passes=0, spans=(), pos=0, written=0, synced=0,
            **flags):
    monkeypatch.setattr(checks, "_CHUNK", 256)
    monkeypatch.setattr(checks, "_SYNC", 100)
    fd = os.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        s = checks.Stream(fd, Expected(md5="x"))
        s.abandon()  # its own follower stopped: _follow runs here, under _Looks
        s._closed = False
        s._cond, s._spans, s.hashes.pos = _Looks(passes), [list(x) for x in spans], pos
        s._written, s._synced = written, synced
        for name, value in flags.items():
            setattr(s, name, value)
        s._follow()
        assert isinstance(s._error, _Stop)
        return s
    finally:
        os.close(fd)


@pytest.mark.parametrize("state, wakes", [
    ({}, False),
    ({"_overlap": True}, True),  # a rewrite: stop following now
    ({"_closed": True}, True),
    ({"spans": [(0, 300)], "pos": 256}, False),  # 44 bytes past what is hashed: not a chunk
    ({"spans": [(0, 512)], "pos": 256}, True),  # exactly a chunk
    ({"written": 60, "synced": 50}, False),  # 10 bytes since the last write-back
    ({"written": 150, "synced": 50}, True),  # exactly _SYNC since it
])
def test_the_follower_wakes_for_a_whole_chunk_a_due_write_back_or_the_end(
        tmp_path, monkeypatch, state, wakes):
    assert _driven(tmp_path, monkeypatch, **state)._cond.said == [wakes]


def test_the_follower_writes_back_when_due_and_counts_from_there(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(checks.os, "fdatasync", synced.append)
    s = _driven(tmp_path, monkeypatch, passes=1, written=150, synced=50)
    assert len(synced) == 1 and s._synced == 150
    synced.clear()
    s = _driven(tmp_path, monkeypatch, passes=1, written=60, synced=50)  # not due
    assert synced == [] and s._synced == 50


def test_md5_is_asked_for_as_a_non_security_use(monkeypatch):
    # a FIPS-restricted OpenSSL refuses MD5 unless it is flagged usedforsecurity=False
    real = hashlib.md5

    def fips_md5(*args, usedforsecurity=True):
        if usedforsecurity is not False:
            raise ValueError("[digital envelope routines] unsupported")
        return real(*args, usedforsecurity=False)

    monkeypatch.setattr(checks.hashlib, "md5", fips_md5)
    data = b"abc" * 10
    assert _hashed(Expected(md5="x"), data).md5.hexdigest() == real(data).hexdigest()
