"""What a download is checked against (`expected`: an MD5 ETag, a stored full-object or composite
CRC), the CRCs S3 stores computed in order (`Crc`) or on bytes written in any order (`Runs`, joined
with awscrt's CRC combination), and the check that runs while s3transfer writes them (`Stream`).
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Any

from diag.storage.objectstore import failure

# The checksums S3 keeps, and the name of each function that computes it
CRCS = {"ChecksumCRC32": "crc32", "ChecksumCRC32C": "crc32c", "ChecksumCRC64NVME": "crc64nvme"}
_CHUNK = 8 << 20  # bytes hashed per read-back: large enough that hashing runs without the GIL
_SYNC = 64 << 20  # bytes written between early write-backs (fdatasync) during a download


def _fn(name: str) -> Any:
    """zlib's CRC32, else awscrt's (what botocore uses for these); ImportError without awscrt."""
    if name == "crc32":
        return zlib.crc32
    from awscrt import checksums

    return getattr(checksums, name)


class Crc:
    """A CRC with hashlib's update()."""

    def __init__(self, name: str) -> None:
        self.name, self.value, self._fn = name, 0, _fn(name)
        self.width = 8 if name == "crc64nvme" else 4

    def update(self, data: bytes | memoryview) -> None:
        self.value = self._fn(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(self.width, "big")

    def b64(self) -> str:
        return base64.b64encode(self.digest()).decode()


class Runs:
    """CRCs of bytes written in any order: a running CRC per contiguous run, cut at bounds."""

    def __init__(self, name: str, bounds: list[int]) -> None:
        from awscrt import checksums  # ImportError: the follower computes the CRCs instead

        self.fn, self.combine = _fn(name), getattr(checksums, f"combine_{name}")
        self.bounds = bounds  # each segment's end offset, ascending
        self.runs: dict[int, list[int]] = {}  # start -> [end, crc]
        self.ends: dict[int, int] = {}  # end -> start

    def add(self, start: int, view: memoryview) -> None:
        while len(view):
            i = bisect.bisect_right(self.bounds, start)
            if i == len(self.bounds):
                return  # bytes past the object's size: the size check refuses them
            take = view[: self.bounds[i] - start]
            begun = self.ends.pop(start, None)
            # a segment's first byte starts its own run: segments() cannot cut one spanning two
            if begun is None or (i and self.bounds[i - 1] == start):
                begun = start
                self.runs[start] = [start, 0]
            run = self.runs[begun]
            run[0], run[1] = start + len(take), self.fn(take, run[1])
            self.ends[run[0]] = begun
            start, view = start + len(take), view[len(take):]

    def segments(self) -> list[int] | None:
        """Each segment's CRC; None unless the runs tile every segment exactly."""
        out, pos = [], 0
        for end in self.bounds:
            crc = None
            while pos < end:
                run = self.runs.get(pos)
                if run is None or run[0] > end:
                    return None
                crc = run[1] if crc is None else self.combine(crc, run[1], run[0] - pos)
                pos = run[0]
            out.append(crc or 0)
        return out


class Mismatch(Exception):
    """The bytes received differ from the object (its MD5 ETag, or a stored CRC)."""


@dataclass(frozen=True)
class Expected:
    """What the landed bytes must match (besides the listed size)."""

    md5: str = ""  # the ETag, when it is the MD5 of the bytes
    crc: tuple[str, str] | None = None  # full-object (algorithm, base64)
    composite: tuple[str, str, tuple[int, ...]] | None = None  # (algorithm, stored, part sizes)
    encrypted: bool = False  # SSE-KMS / SSE-C: a single-part ETag is no MD5


def head(client: Any, bucket: str, key: str, etag: str) -> dict[str, Any]:
    """HEAD with the stored checksum; an ETag moved since the listing is an error of its own."""
    got = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    if got["ETag"].strip('"') != etag:
        raise failure(f"s3://{bucket}/{key}", client, "the object changed while it was landing; "
                      "run again")
    return got


def stored_crc(got: dict[str, Any]) -> tuple[str, str] | None:
    """(algorithm, base64) of the checksum a HEAD says the store keeps, or None."""
    return next(((name, str(got[f])) for f, name in CRCS.items() if got.get(f)), None)


def encrypted(got: dict[str, Any]) -> bool:
    return (str(got.get("ServerSideEncryption", "")).startswith("aws:kms")
            or bool(got.get("SSECustomerAlgorithm")))


def expected(client: Any, bucket: str, key: str, size: int, etag: str, md5_etag: bool,
             ranged: bool) -> Expected:
    """What to check one object against (no HEAD for a single GET with an MD5 ETag)."""
    if md5_etag and not ranged:
        return Expected(md5=etag.lower())
    got = head(client, bucket, key, etag)
    kms = encrypted(got)
    md5 = etag.lower() if md5_etag and not kms else ""
    stored = stored_crc(got)
    if stored is None:
        return Expected(md5=md5, encrypted=kms)
    kind = got.get("ChecksumType") or ""
    name, value = stored
    # multipart CRC32/CRC32C is COMPOSITE unless the store says FULL_OBJECT (moto omits the type)
    if kind == "COMPOSITE" or "-" in value or (not kind and "-" in etag and name != "crc64nvme"):
        return Expected(md5=md5, composite=(name, value, part_sizes(client, bucket, key, size)),
                        encrypted=kms)
    return Expected(md5=md5, crc=stored, encrypted=kms)


def part_sizes(client: Any, bucket: str, key: str, size: int, every: bool = False
               ) -> tuple[int, ...]:
    """The uploader's part sizes: from part 1's HEAD (SDKs cut equal parts), else one per part."""
    first = client.head_object(Bucket=bucket, Key=key, PartNumber=1)
    count, one = int(first.get("PartsCount") or 1), int(first["ContentLength"])
    last = size - (count - 1) * one
    if not every and 0 < last <= one:
        return (one,) * (count - 1) + (last,)
    return tuple([one] + [int(client.head_object(Bucket=bucket, Key=key, PartNumber=n)
                              ["ContentLength"]) for n in range(2, count + 1)])


def whole_name(want: Expected) -> str:
    """The CRC the manifest records (what a hit re-checks): the store's, else CRC32."""
    return (want.crc or want.composite or ("crc32",))[0]


class _Hashes:
    """`want`'s hashes and the whole file's CRC, fed in file order (crcs False: the writer's)."""

    def __init__(self, want: Expected, crcs: bool = True) -> None:
        self.want, self.pos, self.note, self.crcs = want, 0, "", crcs
        self.md5 = hashlib.md5(usedforsecurity=False) if want.md5 else None
        self.crc = self.parts = None
        name = whole_name(want)
        try:
            self.whole = Crc(name)
            self.crc = self.whole if want.crc else None
            if want.composite:
                self.parts, self.part, self.part_end = [], Crc(name), want.composite[2][0]
        except ImportError:  # CRC32C / CRC64NVME without awscrt: recorded as not checked
            self.note, self.whole = f"{name} stored, not checked: pip install awscrt", Crc("crc32")

    def update(self, view: memoryview) -> None:
        if self.md5 is not None:
            self.md5.update(view)
        if self.crcs:
            self.whole.update(view)
            if self.parts is not None:
                self._cut(view)
        self.pos += len(view)

    def _cut(self, view: memoryview) -> None:
        """Composite: one CRC per uploader part, each cut at its part's bounds."""
        sizes, at = self.want.composite[2], self.pos
        while len(view) and len(self.parts) < len(sizes):  # bytes past the last part: the
            take = view[: self.part_end - at]               # size check has refused them
            self.part.update(take)
            at, view = at + len(take), view[len(take):]
            if at == self.part_end:
                self.parts.append(self.part.digest())
                self.part = Crc(self.part.name)
                if len(self.parts) < len(sizes):
                    self.part_end += sizes[len(self.parts)]

    def set_crcs(self, runs: Runs) -> None:
        """The CRCs the writer computed: the whole file's, and one per uploader part."""
        segments = runs.segments()
        if self.parts is not None:
            self.parts = [v.to_bytes(self.part.width, "big") for v in segments]
        self.whole.value, prev = segments[0], runs.bounds[0]
        for value, end in zip(segments[1:], runs.bounds[1:]):
            self.whole.value, prev = runs.combine(self.whole.value, value, end - prev), end

    def digest(self) -> str:
        """The manifest's record of the file: '<crc name>:<base64>'."""
        return f"{self.whole.name}:{self.whole.b64()}"

    def composite(self) -> str:
        """The CRC of the part CRCs' concatenation, "-N"."""
        crc = Crc(self.part.name)
        crc.update(b"".join(self.parts))
        return f"{crc.b64()}-{len(self.parts)}"

    def verdict(self) -> tuple[str, str]:
        """(digest, what was checked); Mismatch if a stored checksum fails (MD5: the caller's)."""
        checks = "size"
        if self.crc is not None:
            if self.crc.b64() != self.want.crc[1]:
                raise Mismatch(f"full-object {self.crc.name.upper()} {self.crc.b64()}, the "
                               f"store has {self.want.crc[1]}")
            checks += f", full-object {self.crc.name.upper()}"
        elif self.parts is not None:
            name, stored, sizes = self.want.composite
            got = self.composite()
            # a store may give the value without its "-N" (moto): compare what it gives
            if got != stored and got.split("-")[0] != stored:
                raise Mismatch(f"composite {name.upper()} of {len(sizes)} parts {got}, the store "
                               f"has {stored}")
            checks += f", {name.upper()} of each of {len(sizes)} parts (composite)"
        elif self.note:
            checks += f" ({self.note})"
        return self.digest(), checks


class Stream:
    """One download's check as s3transfer writes into `sink` (the writer computes the CRCs)."""

    def __init__(self, fd: int, want: Expected, size: int = 0) -> None:
        self.fd, self.want = fd, want
        self._inline: Runs | None = None
        if size:
            sizes = want.composite[2] if want.composite else (size,)
            try:
                self._inline = Runs(whole_name(want),
                                    [sum(sizes[: i + 1]) for i in range(len(sizes))])
            except ImportError:  # no awscrt: the follower computes them (CRC32 via zlib)
                pass
        self.hashes = _Hashes(want, crcs=self._inline is None)
        self._spans: list[list[int]] = []  # written [start, end), disjoint, sorted
        self._written = self._synced = 0
        self._cond = threading.Condition()
        self._closed = self._overlap = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()
        self.sink, self._pos = self, 0  # the file object s3transfer seeks and writes, one thread

    def wrote(self, start: int, end: int, data: memoryview | None = None) -> None:
        if self._inline is not None and data is not None:
            self._inline.add(start, data)  # in the writer's thread, on the bytes in hand
        with self._cond:
            self._written += end - start
            spans = self._spans
            i = next((k for k, s in enumerate(spans) if s[0] >= start), len(spans))
            if (i > 0 and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
                self._overlap = True  # rewritten bytes: the streamed hashes may be stale
            if i > 0 and spans[i - 1][1] >= start:
                spans[i - 1][1] = max(spans[i - 1][1], end)
                i -= 1
            else:
                spans.insert(i, [start, end])
            while i + 1 < len(spans) and spans[i + 1][0] <= spans[i][1]:
                spans[i][1] = max(spans[i][1], spans.pop(i + 1)[1])
            if spans[0][0] == 0:  # the prefix may have grown
                self._cond.notify()

    def _prefix(self) -> int:
        return self._spans[0][1] if self._spans and self._spans[0][0] == 0 else 0

    def _follow(self) -> None:
        buf = bytearray(_CHUNK)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._closed or self._overlap
                                        or self._prefix() - self.hashes.pos >= _CHUNK
                                        or self._written - self._synced >= _SYNC)
                    if self._overlap or self._closed:
                        return  # finish() hashes the rest (or, after an overlap, all) itself
                    upto, written = self._prefix(), self._written
                if written - self._synced >= _SYNC:  # the final fsync then has little to write
                    os.fdatasync(self.fd)
                    self._synced = written
                self._read(buf, upto)
        except BaseException as err:  # noqa: BLE001  raised again by finish()
            self._error = err

    def _read(self, buf: bytearray, upto: int) -> None:
        if self.hashes.md5 is None and not self.hashes.crcs:  # the writer computed every CRC
            self.hashes.pos = max(self.hashes.pos, upto)
            return
        view = memoryview(buf)
        while self.hashes.pos < upto:
            n = os.preadv(self.fd, [view[: min(_CHUNK, upto - self.hashes.pos)]], self.hashes.pos)
            if n <= 0:
                break
            self.hashes.update(view[:n])

    def finish(self) -> _Hashes:
        """Hash what the thread has not (the tail, or the whole file after a rewrite)."""
        self.abandon()
        if self._error is not None:
            raise self._error
        segments = None if self._overlap or self._inline is None else self._inline.segments()
        if self._overlap or (self._inline is not None and segments is None):
            self.hashes = _Hashes(self.want)  # one pass over the file as it is: every hash
            segments = None
        self._read(bytearray(_CHUNK), os.fstat(self.fd).st_size)
        if segments is not None:
            self.hashes.set_crcs(self._inline)
        return self.hashes

    def abandon(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: bytes) -> int:
        view, done = memoryview(data), 0
        while done < len(view):  # pwrite may write less than asked
            done += os.pwrite(self.fd, view[done:], self._pos + done)
        self.wrote(self._pos, self._pos + done, view)
        self._pos += done
        return done
