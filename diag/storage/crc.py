"""The CRCs S3 stores (x-amz-checksum-*): computed in order (`Crc`), or on bytes that arrive in
any order (`Runs`: one running CRC per contiguous run, joined with awscrt's CRC combination)."""

from __future__ import annotations

import base64
import bisect
import os
import zlib
from typing import Any

# The checksums S3 keeps, and the name of each function that computes it
CRCS = {"ChecksumCRC32": "crc32", "ChecksumCRC32C": "crc32c", "ChecksumCRC64NVME": "crc64nvme"}


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


def file_crc(path: str | os.PathLike[str], name: str) -> str:
    """The base64 CRC (`name`) of a whole file, read once (a landed copy's hit check)."""
    crc, buf = Crc(name), bytearray(8 << 20)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc.update(memoryview(buf)[:n])
    return crc.b64()


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
