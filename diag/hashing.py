"""File digests in one pass over the bytes: the one place diag hashes a file.

sha256 is what a landing manifest and a hub LFS ETag record; MD5 is what a single-part S3 ETag is;
the git blob sha1 is what the hub calls a small file. `hashlib.file_digest` reads with a buffer
of its own (no Python loop per chunk), so hashing runs at the speed of the hash, not of Python.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

ALGORITHMS = ("sha256", "md5", "sha1", "git-sha1")


class _Several:
    """Feeds every hash the same bytes, so several digests cost one read."""

    def __init__(self, hashes: dict[str, Any]) -> None:
        self.hashes = hashes

    def update(self, data: bytes | memoryview) -> None:
        for h in self.hashes.values():
            h.update(data)


def _new(name: str, size: int) -> Any:
    if name == "git-sha1":
        return hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False)
    if name == "md5":
        return hashlib.md5(usedforsecurity=False)
    if name in ("sha256", "sha1"):
        return hashlib.new(name)
    raise ValueError(f"algorithm={name!r}: allowed values are " + ", ".join(map(repr, ALGORITHMS)))


def file_digests(path: str | os.PathLike[str], *algorithms: str) -> dict[str, str]:
    """{algorithm: hex digest} of the file's bytes, every algorithm in one read."""
    names = algorithms or ("sha256",)
    size = os.path.getsize(path)
    several = _Several({name: _new(name, size) for name in names})
    with open(path, "rb", buffering=0) as f:
        hashlib.file_digest(f, lambda: several)  # type: ignore[arg-type]  # any .update() works
    return {name: h.hexdigest() for name, h in several.hashes.items()}


def file_sha256(path: str | os.PathLike[str]) -> str:
    return file_digests(path, "sha256")["sha256"]


def git_blob_sha1(data: bytes) -> str:
    """The id git (and the HF hub, for non-LFS files) gives these bytes: sha1 of a blob header + data."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
