"""File digests in one pass over the bytes, and the one way diag writes a file or folder whole.

`atomic_file` / `atomic_folder` write under a temporary name (`.<name>.tmp-<pid>-<8 hex>`), fsync
and swap in: a target is old or whole, never part; `sweep_orphans` removes a killed writer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

ALGORITHMS = ("sha256", "md5", "sha1", "git-sha1")
# temp_path's names, and the scratch folders of diag storage before it used them
_TEMP = re.compile(r"\..+\.tmp-(?P<pid>\d+)-[0-9a-f]{8}|diag-storage-(?P<old>\d+)")


def file_digests(path: str | os.PathLike[str], *algorithms: str) -> dict[str, str]:
    """{algorithm: hex digest} of the file's bytes, every algorithm in one read."""
    if wrong := [a for a in algorithms if a not in ALGORITHMS]:
        raise ValueError(f"algorithm={wrong[0]!r}: allowed values are "
                         + ", ".join(map(repr, ALGORITHMS)))
    size = os.path.getsize(path)  # git-sha1 hashes a "blob <size>" header first
    hashes = {name: hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False) if name == "git-sha1"
              else hashlib.new(name, usedforsecurity=False) for name in algorithms or ("sha256",)}
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            for h in hashes.values():
                h.update(chunk)
    return {name: h.hexdigest() for name, h in hashes.items()}


def file_sha256(path: str | os.PathLike[str]) -> str:
    return file_digests(path, "sha256")["sha256"]


def git_blob_sha1(data: bytes) -> str:
    """The id git (and the HF hub, for non-LFS files) gives these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Make a file's bytes, or a folder's entries (a rename into it), durable on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(target: str | os.PathLike[str]) -> Path:
    """`.<name>.tmp-<pid>-<8 hex>` beside target: hidden, unique, its pid for `sweep_orphans`."""
    target = Path(target)
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """`with atomic_file(path) as tmp:` write tmp; a clean exit fsyncs and renames it over path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str], *, replace: bool = True) -> Iterator[Path]:
    """The yielded folder, swapped in whole on a clean exit (replace=False keeps one there)."""
    path = Path(path)
    tmp = temp_path(path)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for folder, _, names in os.walk(tmp):  # the bytes are on disk before the name is
            for name in names:
                fsync_path(os.path.join(folder, name))
            fsync_path(folder)
        old = temp_path(path)
        if replace and path.exists():
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except OSError:
            if replace or not path.is_dir():
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sweep_orphans(folder: str | os.PathLike[str]) -> None:
    """Remove folder's temporaries whose writer (this machine's pid) no longer runs."""
    import psutil

    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    for entry in entries:
        found = _TEMP.fullmatch(entry.name)
        if found is None or psutil.pid_exists(int(found["pid"] or found["old"])):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):  # another sweep got there first
                os.unlink(entry.path)


def scratch_folder(name: str, base: str | os.PathLike[str] | None = None) -> Path:
    """A new empty scratch folder in base (default: the temp folder); a killed run's is swept."""
    base = Path(base) if base else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    sweep_orphans(base)
    folder = temp_path(base / name)
    folder.mkdir()
    return folder
