"""Download one object with the engine the benchmark times (s3transfer), then diag's own checks.

`download()` runs boto3's `download_file` with the TransferConfig of `transfer_plan()` into a
partial file beside the destination, then checks its size, the MD5 of a single-part ETag or the
full-object CRC the store keeps for a multipart object (hashed beside the manifest's sha256),
fsyncs and renames: the final path is whole or absent. It returns the sha256 and a line
saying what was checked, which land() writes into the manifest.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from diag.hashing import file_digests, fsync_path
from diag.secrets import redact
from diag.storage.objectstore import (RemoteObject, TransferPlan, md5_checkable, remote_error,
                                      transfer_plan, usable_cores)

# The full-object checksums S3 keeps (ChecksumType FULL_OBJECT), and how to compute each. A
# COMPOSITE checksum ("...-N", the default of multipart uploads by older SDKs) is a checksum of
# the part checksums: like a multipart ETag it depends on the uploader's part size.
FULL_OBJECT_CRCS = {"ChecksumCRC32": "crc32", "ChecksumCRC32C": "crc32c",
                    "ChecksumCRC64NVME": "crc64nvme"}
_ATTEMPTS = 3  # downloads before bytes that keep failing a check are called corrupted on the way


class _Mismatch(Exception):
    """The bytes received differ from the object (MD5 vs ETag, the full-object CRC, or a
    checksum botocore validated on a whole-object GET)."""


class _Crc:
    """A CRC with hashlib's update(): zlib for CRC32; awscrt (what botocore itself uses for these
    algorithms) for CRC32C and CRC64NVME."""

    def __init__(self, name: str) -> None:
        self.name, self.value = name, 0
        if name == "crc32":
            import zlib

            self._fn, self._width = zlib.crc32, 4
        else:
            from awscrt import checksums  # ImportError: the caller reports the check as skipped

            self._fn, self._width = getattr(checksums, name), 4 if name == "crc32c" else 8

    def update(self, data: bytes | memoryview) -> None:
        self.value = self._fn(data, self.value)

    def b64(self) -> str:
        return base64.b64encode(self.value.to_bytes(self._width, "big")).decode()


def full_object_checksum(client: Any, bucket: str, key: str) -> tuple[str, str] | None:
    """(algorithm, base64 value) of the object's full-object CRC, or None if it has none."""
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    if head.get("ChecksumType") != "FULL_OBJECT":
        return None
    return next(((name, head[f]) for f, name in FULL_OBJECT_CRCS.items() if head.get(f)), None)


def download_all(client: Any, bucket: str, targets: list[tuple[RemoteObject, Path]], *,
                 retries: int | None = None) -> list[tuple[str, str]]:
    """download() every (object, destination), each with its transfer_plan(): objects that go in
    one GET run 2 x usable_cores() at a time (the parallelism of many small shards is across
    objects), larger ones one after another, each cut into parts. Results in targets' order."""
    plans = [transfer_plan(o.size) for o, _ in targets]
    small = [i for i, (o, _) in enumerate(targets) if o.size < plans[i].single_get_below]
    out: dict[int, tuple[str, str]] = {}
    if len(small) > 1:
        with ThreadPoolExecutor(min(2 * usable_cores(), len(small))) as pool:
            futures = {i: pool.submit(download, client, bucket, targets[i][0], targets[i][1],
                                      plan=plans[i], retries=retries) for i in small}
            out.update({i: f.result() for i, f in futures.items()})
    for i, (o, dest) in enumerate(targets):
        if i not in out:
            out[i] = download(client, bucket, o, dest, plan=plans[i], retries=retries)
    return [out[i] for i in range(len(targets))]


def describe(objects: list[RemoteObject]) -> str:
    """What download_all runs for these objects, in words (the benchmark rows' detail)."""
    plans = [transfer_plan(o.size) for o in objects]
    if len(objects) > 1 and all(o.size < p.single_get_below for o, p in zip(objects, plans)):
        how = f"one GET per object, {min(2 * usable_cores(), len(objects))} objects at a time"
    else:
        how = plans[0].describe(objects[0].size)
    return f"land()'s engine: s3transfer, {how} ({usable_cores()} cores), checked, fsynced"


def download(client: Any, bucket: str, obj: RemoteObject, dest: Path, *, plan: TransferPlan,
             retries: int | None = None) -> tuple[str, str]:
    """Download one object to dest atomically; return (sha256, what was checked).

    s3transfer fetches the object (one GET, or ranged parts `plan.concurrency` at a time; a
    dropped stream is fetched again from the start of its part, `retries` + 1 times, default 5).
    Bytes that fail a check are discarded and fetched again, at most twice more, then it raises.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    where = f"s3://{bucket}/{obj.key} (endpoint {client.meta.endpoint_url})"
    try:
        expected = None if md5_checkable(obj.etag) else full_object_checksum(client, bucket,
                                                                             obj.key)
    except (ClientError, BotoCoreError) as err:
        raise remote_error(err, f"s3://{bucket}/{obj.key}", client) from None
    for _ in range(_ATTEMPTS):
        try:
            return _download_once(client, bucket, obj, dest, plan, retries, expected)
        except _Mismatch as err:
            why = str(err)  # a flipped bit in transit is rare: fetch again; three is a pattern
        except (ClientError, BotoCoreError) as err:  # the HEAD that explains an MD5 mismatch
            raise remote_error(err, f"s3://{bucket}/{obj.key}", client) from None
    raise RuntimeError(redact(
        f"{where}: the bytes received do not match the object ({why}) in {_ATTEMPTS} downloads: "
        "they were corrupted on the way (a proxy or middlebox rewriting data, a faulty NIC or "
        "memory); nothing was kept"))


def _download_once(client: Any, bucket: str, obj: RemoteObject, dest: Path, plan: TransferPlan,
                   retries: int | None, expected: tuple[str, str] | None) -> tuple[str, str]:
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    try:
        _transfer(client, bucket, obj, partial, plan, retries)
        size = partial.stat().st_size
        if size != obj.size:
            raise RuntimeError(f"s3://{bucket}/{obj.key}: landed {size} bytes, the object has "
                               f"{obj.size}")
        # the rename below must never publish bytes still only in memory: fsync waits on the
        # disk while the checks hash the same bytes from the page cache, so one hides the other
        with ThreadPoolExecutor(1) as pool:
            synced = pool.submit(fsync_path, partial)
            try:
                digest, checks = _check(client, bucket, obj, partial, expected)
            finally:
                synced.result()
        os.replace(partial, dest)
    except OSError as err:
        partial.unlink(missing_ok=True)
        if err.errno == errno.ENOSPC:
            raise RuntimeError(f"s3://{bucket}/{obj.key}: the disk holding {dest.parent} filled "
                               "up during the download; nothing partial was kept") from None
        raise
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return digest, checks


def _transfer(client: Any, bucket: str, obj: RemoteObject, partial: Path, plan: TransferPlan,
              retries: int | None) -> None:
    """boto3's download_file (s3transfer writes `<partial>.<random>` and renames it), its
    failures turned into one line naming the object, the endpoint and what to do."""
    from boto3.exceptions import RetriesExceededError
    from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError
    from s3transfer.exceptions import S3DownloadFailedError

    url = f"s3://{bucket}/{obj.key}"
    try:
        client.download_file(bucket, obj.key, str(partial), Config=plan.transfer_config(retries))
    except FlexibleChecksumError as err:  # botocore checked a whole-object GET's stored CRC
        raise _Mismatch(f"the store's checksum: {err}") from None
    except RetriesExceededError as err:
        attempts = plan.transfer_config(retries).num_download_attempts
        raise RuntimeError(redact(
            f"{url} (endpoint {client.meta.endpoint_url}): the connection dropped {attempts} "
            f"times ({type(err.last_exception).__name__}), gave up; raise --retries or check "
            "the network")) from None
    except S3DownloadFailedError as err:  # s3transfer's ETag pin: the object changed mid-way
        raise RuntimeError(redact(f"{url} (endpoint {client.meta.endpoint_url}): {err}; it "
                                  "changed while it was landing: run again")) from None
    except (ClientError, BotoCoreError) as err:
        raise remote_error(err, url, client) from None


def _check(client: Any, bucket: str, obj: RemoteObject, partial: Path,
           expected: tuple[str, str] | None) -> tuple[str, str]:
    """(sha256, what was checked) in one read of the landed bytes; _Mismatch if they differ."""
    if md5_checkable(obj.etag):
        got = file_digests(partial, "sha256", "md5")
        if got["md5"] == obj.etag.lower():
            return got["sha256"], "size, MD5 = ETag"
        if _encrypted(client, bucket, obj):  # SSE-KMS / SSE-C: that ETag is no MD5
            return got["sha256"], "size (SSE-KMS/SSE-C: the ETag is no MD5)"
        raise _Mismatch(f"MD5 {got['md5']}, ETag {obj.etag}")
    if expected is None:
        return file_digests(partial, "sha256")["sha256"], "size (no full-object checksum stored)"
    name, value = expected
    try:
        crc = _Crc(name)
    except ImportError:
        return (file_digests(partial, "sha256")["sha256"],
                f"size ({name} stored, not checked: pip install awscrt)")
    # two threads, two reads from the page cache: both hashes release the GIL, so the CRC costs
    # no wall time where a core is free (on 2 busy cores it costs what one read would)
    with ThreadPoolExecutor(1) as pool:
        crc_done = pool.submit(_digest_into, partial, crc)
        sha256 = file_digests(partial, "sha256")["sha256"]
        crc_done.result()
    if crc.b64() != value:
        raise _Mismatch(f"full-object {name.upper()} {crc.b64()}, the store has {value}")
    return sha256, f"size, full-object {name.upper()}"


def _digest_into(path: Path, h: Any) -> None:
    with open(path, "rb", buffering=0) as f:
        hashlib.file_digest(f, lambda: h)


def _encrypted(client: Any, bucket: str, obj: RemoteObject) -> bool:
    """Whether the object's ETag is no MD5 because of its encryption; an object that changed
    since it was listed is an error of its own (no number of downloads would match)."""
    head = client.head_object(Bucket=bucket, Key=obj.key)
    if head["ETag"].strip('"') != obj.etag:
        raise RuntimeError(redact(f"s3://{bucket}/{obj.key} (endpoint {client.meta.endpoint_url})"
                                  ": the object changed while it was landing; run again"))
    return (str(head.get("ServerSideEncryption", "")).startswith("aws:kms")
            or bool(head.get("SSECustomerAlgorithm")))
