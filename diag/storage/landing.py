"""`land()`: a dataset from an object store on local disk once, verified, then reused; complete
when its manifest is written, last, and a hit while the listing and local files match it. Each
object is downloaded by s3transfer into an atomic file while diag.storage.checks hashes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.config import VERIFY_MODES
from diag.config.source import MANIFEST_SUFFIX, S3Url, parse_s3
from diag.files import atomic_file, file_sha256, fsync_path, sweep_orphans
from diag.storage import checks
from diag.storage.objectstore import (MB, RemoteObject, TransferPlan, failure, list_s3, make_client,
                                      remote_error, transfer_plan, usable_cores)


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
    if not path.is_file() or path.stat().st_size != entry["size"]:
        return False  # gone, truncated or grown: cheap, always checked
    if verify == "size":
        return True
    if "digest" not in entry:  # a manifest of an older diag
        return file_sha256(path) == entry["sha256"]
    name, value = entry["digest"].split(":", 1)
    try:
        return checks.file_crc(path, name) == value
    except ImportError:  # recorded with awscrt, which this Python lacks: land it again
        return False


def land(url: str, cache_dir: str | os.PathLike[str], *, client: Any = None, timer: Any = None,
         verify: str = "sha256", retries: int | None = None) -> LandedDataset:
    """Land s3://bucket/key (or a prefix) in cache_dir once, timed as `fetch_data`."""
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
    for obj, (digest, checked) in zip(todo, got):
        entries[obj.key] = {"key": obj.key, "size": obj.size, "etag": obj.etag,
                            "digest": digest, "checks": checked}
    for key in set(known) - set(dests):  # shards gone from the prefix: drop our old copies
        _dest(u, local, key).unlink(missing_ok=True)
    for folder in {d.parent for d in dests.values()}:
        fsync_path(folder)  # the renamed data files are durable before the manifest is
    with atomic_file(manifest_path) as tmp:
        tmp.write_text(json.dumps({"url": str(u), "bytes": total,
                                   "objects": [entries[o.key] for o in remote]}, indent=1))
    fsync_path(manifest_path.parent)
    return False, total, needed, len(remote)


_ATTEMPTS = 3  # downloads before bytes that keep failing a check are called corrupted on the way
_NO_MD5 = "SSE-KMS/SSE-C: the ETag is no MD5"


def download_all(client: Any, bucket: str, targets: list[tuple[RemoteObject, Path]], *,
                 retries: int | None = None) -> list[tuple[str, str]]:
    """download() each target in order: one-GET objects 2 x usable_cores() at a time."""
    small = [i for i, (o, _) in enumerate(targets)
             if o.size < transfer_plan(o.size).single_get_below]
    done: dict[int, tuple[str, str]] = {}
    if len(small) > 1:
        with ThreadPoolExecutor(min(2 * usable_cores(), len(small))) as pool:
            done = dict(zip(small, pool.map(
                lambda i: download(client, bucket, *targets[i], retries=retries), small)))
    return [done[i] if i in done else download(client, bucket, o, dest, retries=retries)
            for i, (o, dest) in enumerate(targets)]


def describe(objects: list[RemoteObject]) -> str:
    """What download_all runs for these objects, in words (the benchmark rows' detail)."""
    size, plan = objects[0].size, transfer_plan(objects[0].size)
    if len(objects) > 1 and all(o.size < plan.single_get_below for o in objects):
        how = f"one GET per object, {min(2 * usable_cores(), len(objects))} objects at a time"
    elif size < plan.single_get_below:
        how = "one GET"
    else:
        how = (f"{-(-size // plan.part_bytes)} x {plan.part_bytes / MB:.0f} MB parts, "
               f"{plan.concurrency} at a time")
    return f"land()'s engine: s3transfer, {how} ({usable_cores()} cores), checked, fsynced"


def download(client: Any, bucket: str, obj: RemoteObject, dest: Path,
             retries: int | None = None) -> tuple[str, str]:
    """(digest, what was checked) of one object downloaded to dest atomically, re-fetched twice."""
    from boto3.exceptions import RetriesExceededError
    from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError
    from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded
    from s3transfer.exceptions import S3DownloadFailedError

    url, plan = f"s3://{bucket}/{obj.key}", transfer_plan(obj.size)
    try:
        md5 = re.fullmatch("[0-9a-fA-F]{32}", obj.etag) is not None  # no multipart "-N"
        want = checks.expected(client, bucket, obj.key, obj.size, obj.etag, md5,
                               obj.size >= plan.single_get_below)
        for _ in range(_ATTEMPTS):
            try:
                return _download_once(client, bucket, obj, dest, plan, retries, want)
            except checks.Mismatch as err:
                why = str(err)  # a flipped bit in transit is rare: fetch again; three is a pattern
            except FlexibleChecksumError as err:  # botocore checked a whole-object GET's stored CRC
                why = f"the store's checksum: {err}"
    except (RetriesExceededError, TransferRetriesExceeded) as err:  # download_file's, _fileobj's
        raise failure(url, client, f"the connection dropped "
                      f"{plan.transfer_config(retries).num_download_attempts} times "
                      f"({type(err.last_exception).__name__}), gave up; raise --retries or "
                      "check the network") from None
    except S3DownloadFailedError as err:  # s3transfer's ETag pin: the object changed mid-way
        raise failure(url, client, f"{err}; it changed while it was landing: run again") from None
    except (ClientError, BotoCoreError) as err:  # a HEAD or a GET
        raise remote_error(err, url, client) from None
    raise failure(url, client, f"the bytes received do not match the object ({why}) in "
                  f"{_ATTEMPTS} downloads: they were corrupted on the way (a proxy or middlebox "
                  "rewriting data, a faulty NIC or memory); nothing was kept")


def _download_once(client: Any, bucket: str, obj: RemoteObject, dest: Path, plan: TransferPlan,
                   retries: int | None, want: checks.Expected) -> tuple[str, str]:
    """s3transfer writes into atomic_file's name while checks.Stream hashes it; fsync beside."""
    try:
        with atomic_file(dest) as partial:
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                stream = checks.Stream(fd, want, obj.size)
                try:
                    client.download_fileobj(bucket, obj.key, stream,
                                            Config=plan.transfer_config(retries))
                    if (size := os.fstat(fd).st_size) != obj.size:
                        raise failure(f"s3://{bucket}/{obj.key}", client, f"landed {size} bytes,"
                                      f" the listing says {obj.size}: nothing was kept; run again"
                                      " (an object replaced since it was listed is listed again)")
                except BaseException:
                    stream.abandon()
                    raise
                with ThreadPoolExecutor(1) as pool:
                    synced = pool.submit(os.fsync, fd)
                    try:
                        return _verdict(client, bucket, obj, stream.finish())
                    finally:
                        synced.result()
            finally:
                os.close(fd)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise RuntimeError(f"s3://{bucket}/{obj.key}: the disk holding {dest.parent} filled "
                               "up during the download; nothing partial was kept") from None
        raise


def _verdict(client: Any, bucket: str, obj: RemoteObject, got: checks.Stream) -> tuple[str, str]:
    """(digest, what was checked) from the streamed hashes; Mismatch if the bytes differ."""
    want = got.want
    try:
        digest, checked = got.verdict()  # a stored CRC (full-object or composite) that fails
    except checks.Mismatch:
        if want.composite is None:
            raise
        # part sizes inferred from part 1: ask for each, and if they differ check at those bounds
        exact = checks.part_sizes(client, bucket, obj.key, obj.size, every=True)
        if exact == want.composite[2]:
            raise
        digest, checked = got.finish(dataclasses.replace(
            want, composite=(*want.composite[:2], exact))).verdict()
    if want.composite is not None or not want.md5:  # a multipart ETag is no MD5
        no_crc = not want.composite and want.encrypted and checked == "size"
        return digest, f"size ({_NO_MD5}, no checksum stored)" if no_crc else checked
    md5 = got.md5.hexdigest()
    if md5 == want.md5:
        return digest, checked.replace("size", "size, MD5 = ETag", 1)
    # no HEAD was made before a one-GET object: ask now whether its ETag is an MD5 at all
    head = checks.head(client, bucket, obj.key, obj.etag)
    if not checks.encrypted(head):
        raise checks.Mismatch(f"MD5 {md5}, ETag {obj.etag}")
    stored = checks.stored_crc(head)  # SSE-KMS / SSE-C: the stored checksum, if any, decides
    if stored is None or "-" in stored[1]:
        return digest, f"size ({_NO_MD5}, no checksum stored)"
    checked = got.finish(checks.Expected(crc=stored)).verdict()[1]  # < 32 MB, read again
    return digest, f"{checked} ({_NO_MD5})"
