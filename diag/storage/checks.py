"""What a download is checked against (`expected`: an MD5 ETag, a stored full-object or composite
CRC), and the check that runs while s3transfer writes it (`Stream`): the writer's thread computes
each uploader part's CRC on the bytes in hand (`Runs`, joined with a CRC combination), a follower
thread reads the MD5 back in file order and writes the file back early.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import itertools
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Any

from diag.storage.objectstore import failure

CRCS = {"ChecksumCRC32": "crc32", "ChecksumCRC32C": "crc32c", "ChecksumCRC64NVME": "crc64nvme"}
_CHUNK = 8 << 20  # bytes hashed per read-back: large enough that hashing runs without the GIL
_SYNC = 64 << 20  # bytes written between early write-backs (fdatasync) during a download


def _fn(name: str) -> Any:
    """zlib's CRC32, else awscrt's (what botocore uses for these); ImportError without awscrt."""
    if name == "crc32":
        return zlib.crc32
    from awscrt import checksums

    return getattr(checksums, name)


def _crc32_combine(a: int, b: int, n: int) -> int:
    """zlib's crc32_combine (a CRC is affine in its start: n zeros from a and 0 differ by a's)."""
    zeros, x, y = memoryview(bytes(min(n, _CHUNK))), a, 0
    while n > 0:
        k = min(n, len(zeros))
        x, y, n = zlib.crc32(zeros[:k], x), zlib.crc32(zeros[:k], y), n - k
    return x ^ y ^ b


def _bytes(value: int, name: str) -> bytes:
    return value.to_bytes(8 if name == "crc64nvme" else 4, "big")


def _b64(value: int, name: str) -> str:
    return base64.b64encode(_bytes(value, name)).decode()


def file_crc(path: str | os.PathLike[str], name: str) -> str:
    """The base64 CRC (`name`) of a whole file, read once."""
    fn, value, buf = _fn(name), 0, bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            value = fn(memoryview(buf)[:n], value)
    return _b64(value, name)


class Runs:
    """CRCs of bytes written in any order: a running CRC per contiguous run, cut at each part's
    end (`bounds`); `overlap` once a byte is written twice (the CRCs are then stale)."""

    def __init__(self, name: str, bounds: list[int]) -> None:
        self.name, self.fn = name, _fn(name)
        try:  # CRC(A + B) from CRC(A), CRC(B) and len(B)
            from awscrt import checksums

            self.combine = getattr(checksums, f"combine_{name}")
        except ImportError:  # CRC32 only: _fn has refused the others
            self.combine = _crc32_combine
        self.bounds = bounds  # each part's end offset, ascending
        self.runs: dict[int, list[int]] = {}  # start -> [end, crc]
        self.starts: list[int] = []  # the runs' starts, sorted
        self.overlap, self._head = False, 0

    def add(self, start: int, view: memoryview) -> None:
        j = bisect.bisect_right(self.starts, start)
        if (j and self.runs[self.starts[j - 1]][0] > start and len(view)) or (
                j < len(self.starts) and self.starts[j] < start + len(view)):
            self.overlap = True
        while len(view) and not self.overlap:
            i = bisect.bisect_right(self.bounds, start)
            if i == len(self.bounds):
                return  # bytes past the object's size: the size check refuses them
            take = view[: self.bounds[i] - start]
            j = bisect.bisect_right(self.starts, start)
            run = self.runs[self.starts[j - 1]] if j else None
            # a part's first byte starts its own run: segments() cannot cut one spanning two
            if run is None or run[0] != start or (i and self.bounds[i - 1] == start):
                bisect.insort(self.starts, start)
                run = self.runs[start] = [start, 0]
            run[0], run[1] = start + len(take), self.fn(take, run[1])
            start, view = start + len(take), view[len(take):]

    def prefix(self) -> int:
        """Where the bytes written from offset 0 on end."""
        run = self.runs.get(self._head)
        while run is not None and run[0] in self.runs:
            self._head = run[0]
            run = self.runs[self._head]
        return 0 if run is None else run[0]

    def segments(self) -> list[int] | None:
        """Each part's CRC; None unless the runs tile every part exactly."""
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


class Stream:
    """One download's check, as s3transfer writes into it (a file object over `fd`, one thread)."""

    def __init__(self, fd: int, want: Expected, size: int) -> None:
        self.fd, self.want, self._pos = fd, want, 0
        self._start(size)
        self._prefix = self._written = self._synced = 0
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _start(self, size: int) -> None:
        name, self.note = (self.want.crc or self.want.composite or ("crc32",))[0], ""
        sizes = self.want.composite[2] if self.want.composite else (size,)
        try:
            self.runs = Runs(name, list(itertools.accumulate(sizes)))
        except ImportError:  # CRC32C / CRC64NVME without awscrt: recorded as not checked
            self.note, self.runs = f"{name} stored, not checked: pip install awscrt", Runs(
                "crc32", [size])
        self.md5 = hashlib.md5(usedforsecurity=False) if self.want.md5 else None
        self._hashed = 0  # where the MD5 has read up to

    def _follow(self) -> None:
        buf = bytearray(_CHUNK)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._closed or self.runs.overlap
                                        or (self.md5 is not None
                                            and self._prefix - self._hashed >= _CHUNK)
                                        or self._written - self._synced >= _SYNC)
                    if self._closed or self.runs.overlap:
                        return  # finish() hashes the rest (or, after an overlap, all) itself
                    upto, written = self._prefix, self._written
                if written - self._synced >= _SYNC:  # the final fsync then has little to write
                    os.fdatasync(self.fd)
                    self._synced = written
                self._read(buf, upto)
        except BaseException as err:  # noqa: BLE001  raised again by finish()
            self._error = err

    def _read(self, buf: bytearray, upto: int, crcs: bool = False) -> None:
        """Hash the file in order up to `upto`: the MD5, and with crcs the CRCs too."""
        view = memoryview(buf)
        while self._hashed < upto and (self.md5 is not None or crcs):
            n = os.preadv(self.fd, [view[: min(_CHUNK, upto - self._hashed)]], self._hashed)
            if n <= 0:
                break
            if self.md5 is not None:
                self.md5.update(view[:n])
            if crcs:
                self.runs.add(self._hashed, view[:n])
            self._hashed += n

    def finish(self, want: Expected | None = None) -> Stream:
        """Hash what the follower has not: the tail; all after a rewrite, a gap or a new `want`."""
        self.abandon()
        if self._error is not None:
            raise self._error
        size, crcs = os.fstat(self.fd).st_size, False
        if want is not None or self.runs.overlap or self.runs.segments() is None:
            self.want = want or self.want
            self._start(size)  # one pass over the file as it is: every hash
            crcs = True
        self._read(bytearray(_CHUNK), size, crcs)
        return self

    def abandon(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def verdict(self) -> tuple[str, str]:
        """('<crc>:<base64>', what was checked); Mismatch if a stored CRC (not the MD5) fails."""
        runs, want, checks = self.runs, self.want, "size"
        segments = runs.segments()
        if segments is None:  # the part sizes do not add up to the file's
            raise Mismatch(f"parts of {want.composite[2]} bytes, a file of {runs.prefix()}")
        value = segments[0]
        for crc, start, end in zip(segments[1:], runs.bounds, runs.bounds[1:]):
            value = runs.combine(value, crc, end - start)
        whole = _b64(value, runs.name)
        name = runs.name.upper()
        if self.note:
            checks += f" ({self.note})"
        elif want.crc:
            if whole != want.crc[1]:
                raise Mismatch(f"full-object {name} {whole}, the store has {want.crc[1]}")
            checks += f", full-object {name}"
        elif want.composite:
            stored, n = want.composite[1], len(segments)
            got = _b64(runs.fn(b"".join(_bytes(v, runs.name) for v in segments)), runs.name)
            # a store may give the value without its "-N" (moto): compare what it gives
            if f"{got}-{n}" != stored and got != stored:
                raise Mismatch(f"composite {name} of {n} parts {got}-{n}, the store has {stored}")
            checks += f", {name} of each of {n} parts (composite)"
        return f"{runs.name}:{whole}", checks

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
        self.runs.add(self._pos, view[:done])  # in the writer's thread, on the bytes in hand
        with self._cond:
            self._written += done
            self._prefix = self.runs.prefix()
            self._cond.notify()
        self._pos += done
        return done
