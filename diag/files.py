"""File digests in one pass over the bytes, and the durable swap of a finished file or folder.

sha256 is what a landing manifest and a hub LFS ETag record; MD5 is what a single-part S3 ETag is;
the git blob sha1 is what the hub calls a small file. `hashlib.file_digest` reads with a buffer
of its own (no Python loop per chunk), so hashing runs at the speed of the hash, not of Python.
`fsync_path` and `swap_in` are how every cache diag writes becomes whole or absent.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path
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
    """The id git (and the HF hub, for non-LFS files) gives these bytes: sha1 of a blob header +
    data."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Make a file's bytes, or a folder's entries (a rename into it), durable on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_in(tmp: str | os.PathLike[str], folder: str | os.PathLike[str]) -> None:
    """Replace `folder` by the finished `tmp` beside it: the old one is renamed aside first, so a
    reader sees the old folder or the new one, never a mix of the two."""
    tmp, folder = Path(tmp), Path(folder)
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(folder, old)
    os.rename(tmp, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
