"""`land()`: a dataset from an object store on local disk once, verified, then reused; complete
when its manifest is written, last, and a hit while the listing and local files match it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.config import VERIFY_MODES
from diag.config.source import MANIFEST_SUFFIX, S3Url, parse_s3
from diag.files import atomic_file, file_sha256, fsync_path, sweep_orphans
from diag.storage.crc import file_crc
from diag.storage.objectstore import list_s3, make_client, usable_cores
from diag.storage.transfer import download_all


@dataclass(frozen=True)
class LandedDataset:
    path: Path  # the local file (one object) or folder (a prefix)
    hit: bool  # True: the landed copy was reused, nothing was downloaded
    bytes: int  # size of the whole dataset
    seconds: float  # wall time of this call (listing, checking, downloading)
    files: int = 1
    fetched_bytes: int = 0  # bytes downloaded by this call (0 on a hit)


def local_paths(url: S3Url, cache_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(where the object / prefix lands, its manifest) under cache_dir/<bucket>/<key>."""
    root = Path(cache_dir) / url.bucket
    local = root / url.key.rstrip("/") if url.key.rstrip("/") else root
    return local, local.with_name(local.name + MANIFEST_SUFFIX)


def _dest(url: S3Url, local: Path, key: str) -> Path:
    parts = [p for p in key[len(url.key):].split("/") if p] if url.is_prefix else []
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"s3://{url.bucket}/{key}: a key with '.' or '..' parts cannot land "
                         "safely on a filesystem")
    return local.joinpath(*parts)


def check_free(folder: Path, needed: int, url: S3Url) -> None:
    """A clear error before any download when `needed` bytes do not fit where folder would be."""
    probe = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise RuntimeError(f"not enough free disk to land {url}: need {needed:,} bytes, "
                           f"{free:,} free in {probe}; free space or pick another --local-dir")


def _local_ok(path: Path, entry: dict[str, Any], verify: str) -> bool:
    try:
        if path.stat().st_size != entry["size"]:
            return False  # truncated or grown: cheap, always checked
    except FileNotFoundError:
        return False
    if verify == "size":
        return True
    if "digest" not in entry:  # a manifest of an older diag
        return file_sha256(path) == entry["sha256"]
    name, value = entry["digest"].split(":", 1)
    try:
        return file_crc(path, name) == value
    except ImportError:  # recorded with awscrt, which this Python lacks: land it again
        return False


def land(url: str, cache_dir: str | os.PathLike[str], *, client: Any = None, timer: Any = None,
         verify: str = "sha256", retries: int | None = None) -> LandedDataset:
    """Land s3://bucket/key (or a prefix) in cache_dir once, timed as `fetch_data`: a hit while the
    manifest matches the listing and the files (size; CRC with verify="sha256")."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: allowed values are "
                         + ", ".join(map(repr, VERIFY_MODES)))
    u = parse_s3(url)
    start = time.perf_counter()
    with timer.stage("fetch_data") if timer is not None else contextlib.nullcontext():
        client = client or make_client(retries=retries, max_pool=2 * usable_cores())
        local, manifest = local_paths(u, cache_dir)
        local.parent.mkdir(parents=True, exist_ok=True)
        # several ranks of one node call land() at once: one lands, the others wait, then hit
        with open(manifest.with_name(manifest.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            hit, total, fetched, files = _land(u, local, manifest, client, verify, retries)
    return LandedDataset(local, hit, total, time.perf_counter() - start, files, fetched)


def _land(u: S3Url, local: Path, manifest_path: Path, client: Any, verify: str,
          retries: int | None) -> tuple[bool, int, int, int]:
    remote = list_s3(client, u)
    dests = {o.key: _dest(u, local, o.key) for o in remote}
    for folder in {d.parent for d in dests.values()} | {manifest_path.parent}:
        sweep_orphans(folder)  # a killed landing's partial files are never resumed or trusted
    try:
        old = json.loads(manifest_path.read_text())
        known = {e["key"]: e for e in old["objects"]} if old.get("url") == str(u) else {}
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        known = {}
    entries = {o.key: e for o in remote if (e := known.get(o.key)) and (e["size"], e["etag"]) ==
               (o.size, o.etag) and _local_ok(dests[o.key], e, verify)}
    todo = [o for o in remote if o.key not in entries]
    total = sum(o.size for o in remote)
    if not todo and set(known) == set(dests):
        return True, total, 0, len(remote)
    needed = sum(o.size for o in todo)
    # before anything is touched: a refusal leaves a valid landing valid
    check_free(local.parent, needed, u)
    manifest_path.unlink(missing_ok=True)  # from here until the new one is written, no hit
    for obj in todo:
        dests[obj.key].parent.mkdir(parents=True, exist_ok=True)
    got = download_all(client, u.bucket, [(o, dests[o.key]) for o in todo], retries=retries)
    for obj, (digest, checks) in zip(todo, got):
        entries[obj.key] = {"key": obj.key, "size": obj.size, "etag": obj.etag,
                            "digest": digest, "checks": checks}
    for key in set(known) - set(dests):  # shards gone from the prefix: drop our old copies
        _dest(u, local, key).unlink(missing_ok=True)
    for folder in {d.parent for d in dests.values()}:
        fsync_path(folder)  # the renamed data files are durable before the manifest is
    with atomic_file(manifest_path) as tmp:
        tmp.write_text(json.dumps({"url": str(u), "bytes": total,
                                   "objects": [entries[o.key] for o in remote]}, indent=1))
    fsync_path(manifest_path.parent)
    return False, total, needed, len(remote)
