"""Download objects with s3transfer, atomically, while diag.storage.checks hashes them: the
digest ('<crc>:<base64>') and what was checked go in land()'s manifest.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from diag.files import atomic_file
from diag.storage import checks
from diag.storage.checks import Mismatch
from diag.storage.crc import file_crc
from diag.storage.objectstore import (RemoteObject, TransferPlan, failure, md5_checkable,
                                      remote_error, transfer_plan, usable_cores)

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
            futures = {i: pool.submit(download, client, bucket, *targets[i], retries=retries)
                       for i in small}
            done = {i: f.result() for i, f in futures.items()}
    return [done[i] if i in done else download(client, bucket, o, dest, retries=retries)
            for i, (o, dest) in enumerate(targets)]


def describe(objects: list[RemoteObject]) -> str:
    """What download_all runs for these objects, in words (the benchmark rows' detail)."""
    plans = [transfer_plan(o.size) for o in objects]
    if len(objects) > 1 and all(o.size < p.single_get_below for o, p in zip(objects, plans)):
        how = f"one GET per object, {min(2 * usable_cores(), len(objects))} objects at a time"
    else:
        how = plans[0].describe(objects[0].size)
    return f"land()'s engine: s3transfer, {how} ({usable_cores()} cores), checked, fsynced"


def download(client: Any, bucket: str, obj: RemoteObject, dest: Path,
             retries: int | None = None) -> tuple[str, str]:
    """(digest, what was checked) of one object downloaded to dest atomically, re-fetched twice."""
    from botocore.exceptions import BotoCoreError, ClientError

    url, plan = f"s3://{bucket}/{obj.key}", transfer_plan(obj.size)
    try:
        want = checks.expected(client, bucket, obj.key, obj.size, obj.etag,
                               md5_checkable(obj.etag), obj.size >= plan.single_get_below)
        for _ in range(_ATTEMPTS):
            try:
                return _download_once(client, bucket, obj, dest, plan, retries, want)
            except Mismatch as err:
                why = str(err)  # a flipped bit in transit is rare: fetch again; three is a pattern
    except (ClientError, BotoCoreError) as err:  # a HEAD: what to expect, or an MD5's meaning
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
                    _transfer(client, bucket, obj, stream.sink, plan, retries)
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
                        return _verdict(client, bucket, obj, partial, stream.finish())
                    finally:
                        synced.result()
            finally:
                os.close(fd)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise RuntimeError(f"s3://{bucket}/{obj.key}: the disk holding {dest.parent} filled "
                               "up during the download; nothing partial was kept") from None
        raise


def _transfer(client: Any, bucket: str, obj: RemoteObject, sink: Any, plan: TransferPlan,
              retries: int | None) -> None:
    """boto3's download_fileobj into `sink`, its failures one line naming the object and fix."""
    from boto3.exceptions import RetriesExceededError
    from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError
    from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded
    from s3transfer.exceptions import S3DownloadFailedError

    url, config = f"s3://{bucket}/{obj.key}", plan.transfer_config(retries)
    try:
        client.download_fileobj(bucket, obj.key, sink, Config=config)
    except FlexibleChecksumError as err:  # botocore checked a whole-object GET's stored CRC
        raise Mismatch(f"the store's checksum: {err}") from None
    except (RetriesExceededError, TransferRetriesExceeded) as err:  # download_file's, _fileobj's
        raise failure(url, client, f"the connection dropped {config.num_download_attempts} times"
                      f" ({type(err.last_exception).__name__}), gave up; raise --retries or "
                      "check the network") from None
    except S3DownloadFailedError as err:  # s3transfer's ETag pin: the object changed mid-way
        raise failure(url, client, f"{err}; it changed while it was landing: run again") from None
    except (ClientError, BotoCoreError) as err:
        raise remote_error(err, url, client) from None


def _verdict(client: Any, bucket: str, obj: RemoteObject, partial: Path,
             got: Any) -> tuple[str, str]:
    """(digest, what was checked) from the streamed hashes; Mismatch if the bytes differ."""
    want = got.want
    try:
        digest, checked = got.verdict()  # a stored CRC (full-object or composite) that fails
    except Mismatch:
        if want.composite is None:
            raise
        # part sizes inferred from part 1: ask for each, and if they differ check at those bounds
        name, stored, sizes = want.composite
        exact = checks.part_sizes(client, bucket, obj.key, obj.size, every=True)
        if exact == sizes:
            raise
        fd = os.open(partial, os.O_RDONLY)
        try:  # a Stream with no writes hashes the file as it is, whole
            again = checks.Stream(fd, dataclasses.replace(want, composite=(name, stored, exact)))
            digest, checked = again.finish().verdict()
        finally:
            os.close(fd)
    if want.composite is not None or not want.md5:  # a multipart ETag is no MD5
        no_crc = not want.composite and want.encrypted and checked == "size"
        return digest, f"size ({_NO_MD5}, no checksum stored)" if no_crc else checked
    md5 = got.md5.hexdigest()
    if md5 == want.md5:
        return digest, checked.replace("size", "size, MD5 = ETag", 1)
    # no HEAD was made before a one-GET object: ask now whether its ETag is an MD5 at all
    head = checks.head(client, bucket, obj.key, obj.etag)
    if not checks.encrypted(head):
        raise Mismatch(f"MD5 {md5}, ETag {obj.etag}")
    stored = checks.stored_crc(head)  # SSE-KMS / SSE-C: the stored checksum, if any, decides
    if stored is None or "-" in stored[1]:
        return digest, f"size ({_NO_MD5}, no checksum stored)"
    name, value = digest.split(":", 1)
    if name != stored[0]:  # the file's CRC was computed with another algorithm: this one too
        try:
            value = file_crc(partial, stored[0])  # a one-GET object: < 32 MB, in RAM
        except ImportError:
            return digest, (f"size (SSE-KMS/SSE-C; {stored[0]} stored, not checked: pip install "
                            "awscrt)")
    if value != stored[1]:
        raise Mismatch(f"full-object {stored[0].upper()} {value}, the store has {stored[1]}")
    return digest, f"size, full-object {stored[0].upper()} ({_NO_MD5})"
