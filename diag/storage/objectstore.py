"""The object-store client side: s3:// URLs, boto3 clients, errors a person can act on, listing.

`transfer_plan()` picks one GET or a few large ranged parts from the object size and the cores
this process may use; `download()` fetches an object by ranged GETs into a file, resuming a dropped
connection from the last byte written, refusing an object that changed mid-way (If-Match on its
ETag) and bytes whose MD5 differs from a single-part ETag. Errors name the URL and the endpoint,
never a secret. `land()` in diag.storage.landing builds on these.
"""


import errno
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.hashing import file_digests
from diag.secrets import redact

MB = 1_000_000  # decimal megabytes, like network and disk rates
_CHUNK = 1 << 20  # read/write unit of a streamed GET and of hashing


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str  # "" or ending in "/" = a prefix (many objects), else one object

    @property
    def is_prefix(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class RemoteObject:
    key: str
    size: int
    etag: str  # without quotes


@dataclass(frozen=True)
class TransferPlan:
    single_get_below: int  # objects smaller than this go in one GET
    part_bytes: int
    concurrency: int

    def describe(self, size: int) -> str:
        if size < self.single_get_below:
            return "one GET"
        parts = -(-size // self.part_bytes)
        return f"{parts} x {self.part_bytes / MB:.0f} MB parts, {self.concurrency} at a time"


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (taskset, a container's cpuset, a Slurm
    allocation), not the machine's count, which over-subscribes a job given a slice of a node."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def transfer_plan(size: int, cores: int | None = None) -> TransferPlan:
    """Part size and concurrency for one object of `size` bytes with `cores` cores (default: the
    cores this process may use, `usable_cores()`; the client needs 2 x cores pooled connections).

    Why these numbers: a ranged GET costs a request latency (10-50 ms on S3, ~0.12 s on the
    embedded moto server, which reads the whole object per request) and one connection carries
    ~50-100 MB/s from S3 but ~460 MB/s on loopback, where the client's CPU is the limit. So:
    objects under 32 MB go in one GET (at most 4 parts: not worth the requests); larger ones are
    cut into ~2 parts per core, each 8-256 MB, fetched min(2 x cores, parts) at a time. Many cores
    and a big object (a 25 GB shard on a 32-core box: 256 MB x 98, 64 at a time) fill a NIC;
    on a 2-core box the same rule gives few large parts, which is what wins on loopback.
    """
    cores = max(1, cores or usable_cores())
    single = 32 * MB
    part = min(256 * MB, max(8 * MB, -(-size // (2 * cores))))
    parts = max(1, -(-size // part))
    return TransferPlan(single, part, max(1, min(2 * cores, parts)))


def parse_url(url: str) -> S3Url:
    if not isinstance(url, str) or not url.startswith("s3://") or not url[5:].split("/")[0]:
        raise ValueError(f"source={url!r}: expected s3://bucket/key (one object) or "
                         "s3://bucket/prefix/ (every object under the prefix)")
    bucket, _, key = url[5:].partition("/")
    return S3Url(bucket, key)


def make_client(endpoint_url: str = "", *, credentials: dict[str, str] | None = None,
                retries: int = 4, max_pool: int = 10) -> Any:
    """A boto3 S3 client: the standard AWS chain (AWS_ENDPOINT_URL, AWS_PROFILE, instance role)
    unless endpoint_url / credentials are given; botocore retries failed requests itself."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": retries + 1, "mode": "standard"},
                    max_pool_connections=max(10, max_pool), connect_timeout=5, read_timeout=30)
    kwargs: dict[str, Any] = dict(credentials or {})
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    return boto3.client("s3", config=config, **kwargs)


def remote_error(err: Exception, url: str | S3Url, client: Any) -> RuntimeError:
    """One clear message naming the URL and the endpoint, never a credential."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    endpoint = client.meta.endpoint_url
    where = f"{url} (endpoint {endpoint})"
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchBucket",):
            text = f"{where}: the bucket does not exist at this endpoint"
        elif code in ("NoSuchKey", "404", "NotFound"):
            text = f"{where}: no such object (check the key; a prefix ends with '/')"
        elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                      "InvalidToken", "ExpiredToken", "Forbidden") or status == 403:
            text = (f"{where}: access denied ({code or status}): check the credentials "
                    "(AWS_PROFILE, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, instance role)")
        else:
            text = f"{where}: the server answered {code or status}"
    elif isinstance(err, EndpointConnectionError):
        text = (f"{where}: cannot connect to the endpoint (refused or unreachable); check "
                "--endpoint-url / AWS_ENDPOINT_URL and that the server is up")
    elif isinstance(err, NoCredentialsError):
        text = (f"{where}: no AWS credentials found: set AWS_PROFILE or AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or run on an instance with a role")
    else:
        text = f"{where}: {type(err).__name__}: {err}"
    return RuntimeError(redact(text))


def list_remote(client: Any, url: S3Url) -> list[RemoteObject]:
    """The object (HEAD) or every object under the prefix (LIST): no GET."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        if not url.is_prefix:
            try:
                head = client.head_object(Bucket=url.bucket, Key=url.key)
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    client.head_bucket(Bucket=url.bucket)  # raises NoSuchBucket-like 404 if absent
                raise
            return [RemoteObject(url.key, int(head["ContentLength"]), head["ETag"].strip('"'))]
        found = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=url.bucket,
                                                                     Prefix=url.key):
            for o in page.get("Contents", []):
                if not (o["Key"].endswith("/") and o["Size"] == 0):  # folder markers
                    found.append(RemoteObject(o["Key"], int(o["Size"]), o["ETag"].strip('"')))
    except ClientError as err:
        if (err.response.get("Error", {}).get("Code") in ("404", "NotFound")
                and err.operation_name == "HeadBucket"):
            err.response["Error"]["Code"] = "NoSuchBucket"
        raise remote_error(err, url, client) from None
    except BotoCoreError as err:
        raise remote_error(err, url, client) from None
    if not found:
        raise RuntimeError(f"{url} (endpoint {client.meta.endpoint_url}): no objects under this "
                           "prefix")
    return found


def _transient() -> tuple[type[BaseException], ...]:
    from botocore import exceptions as be
    from urllib3.exceptions import HTTPError

    return (be.ResponseStreamingError, be.IncompleteReadError, be.ReadTimeoutError,
            be.ConnectionClosedError, be.EndpointConnectionError, HTTPError, ConnectionError,
            _ShortBody)


class _ShortBody(Exception):
    """The body ended before the requested range did (a connection closed mid-transfer)."""


def md5_checkable(etag: str) -> bool:
    """True when the ETag is the MD5 of the bytes: 32 hex digits, no "-N" part count.

    A multipart upload's ETag ("<md5 of the part MD5s>-N") depends on the part size the uploader
    chose, so it cannot be recomputed from the bytes: those objects are checked by size, plus
    any full-object checksum (CRC, SHA) the server returns, which botocore itself validates.
    """
    return len(etag) == 32 and all(c in "0123456789abcdefABCDEF" for c in etag)


class _Hashes:
    """sha256 (for the manifest) and, when the ETag allows it, MD5 (against the ETag) in one pass."""

    def __init__(self, md5: bool) -> None:
        self.sha256 = hashlib.sha256()
        self.md5 = hashlib.md5(usedforsecurity=False) if md5 else None

    def update(self, data: bytes | memoryview) -> None:
        self.sha256.update(data)
        if self.md5 is not None:
            self.md5.update(data)


class _Mismatch(Exception):
    """The bytes received differ from the object: MD5 vs a single-part ETag, or a checksum the
    server sent (botocore checks a CRC/SHA stored with the object at the end of its body)."""


def download(client: Any, bucket: str, obj: RemoteObject, dest: Path, *, plan: TransferPlan,
             retries: int = 4) -> str:
    """Download one object to dest atomically; return its sha256.

    Bytes go to `<dest>.partial-<pid>` (same folder, so the rename is atomic), each part by a
    ranged GET pinned to the listed ETag (If-Match: a changed object fails instead of mixing);
    a dropped connection resumes from the last byte written, with backoff, `retries` times. The
    file is fsynced, its size and hashes checked, then renamed: the final path is whole or absent.
    A single-part ETag is the MD5 of the bytes (unless SSE-KMS / SSE-C encrypted them), so MD5 is
    computed in the same pass as sha256 and compared with it: bytes corrupted in transit are
    discarded and fetched again, at most twice more, then it raises.
    """
    attempts = 1 + min(2, retries)
    for _ in range(attempts):
        try:
            return _download_once(client, bucket, obj, dest, plan, retries)
        except _Mismatch as err:
            why = str(err)  # a flipped bit in transit is rare: fetch again; twice is a pattern
    raise RuntimeError(redact(
        f"s3://{bucket}/{obj.key} (endpoint {client.meta.endpoint_url}): the bytes received do "
        f"not match the object ({why}) in {attempts} downloads: they were corrupted on the way "
        "(a proxy or middlebox rewriting data, a faulty NIC or memory); nothing was kept"))


def _download_once(client: Any, bucket: str, obj: RemoteObject, dest: Path, plan: TransferPlan,
                   retries: int) -> str:
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    ranges = [(0, obj.size - 1)] if obj.size < plan.single_get_below else [
        (s, min(s + plan.part_bytes, obj.size) - 1) for s in range(0, obj.size, plan.part_bytes)]
    check_md5 = md5_checkable(obj.etag)
    sequential = _Hashes(check_md5) if len(ranges) == 1 else None
    encrypted: list[str] = []  # SSE-KMS / SSE-C seen in a GET response: the ETag is no MD5
    stop = threading.Event()  # one part gave up: the others stop instead of finishing for nothing
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if obj.size:
            fetch = lambda r: _fetch_range(client, bucket, obj, fd, r, retries, sequential, stop,  # noqa: E731
                                           encrypted)
            with ThreadPoolExecutor(max(1, min(plan.concurrency, len(ranges)))) as pool:
                try:
                    list(pool.map(fetch, ranges))
                except BaseException:
                    stop.set()
                    raise
        os.fsync(fd)  # the rename below must never publish bytes still only in memory
        if os.fstat(fd).st_size != obj.size:
            raise RuntimeError(f"s3://{bucket}/{obj.key}: landed {os.fstat(fd).st_size} bytes, "
                               f"the object has {obj.size}")
        check_md5 = check_md5 and not encrypted
        if sequential is not None:  # hashed on the way in: the bytes are not read again
            got = {"sha256": sequential.sha256.hexdigest(),
                   "md5": sequential.md5.hexdigest() if sequential.md5 else ""}
        else:
            got = file_digests(partial, "sha256", *(("md5",) if check_md5 else ()))
        if check_md5 and got["md5"] != obj.etag.lower():
            raise _Mismatch(f"MD5 {got['md5']}, ETag {obj.etag}")
        digest = got["sha256"]
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
    finally:
        os.close(fd)
    return digest


def _fetch_range(client: Any, bucket: str, obj: RemoteObject, fd: int, span: tuple[int, int],
                 retries: int, hasher: Any, stop: threading.Event, encrypted: list[str]) -> None:
    pos, end = span
    failures = 0
    while pos <= end and not stop.is_set():
        try:
            got = client.get_object(Bucket=bucket, Key=obj.key, Range=f"bytes={pos}-{end}",
                                    IfMatch=f'"{obj.etag}"')
            sse = got.get("ServerSideEncryption", "")
            if sse.startswith("aws:kms") or got.get("SSECustomerAlgorithm"):
                encrypted.append(sse or "SSE-C")
            body = got["Body"]
            try:
                for chunk in body.iter_chunks(_CHUNK):
                    if stop.is_set():
                        return
                    os.pwrite(fd, chunk, pos)
                    if hasher is not None:
                        hasher.update(chunk)
                    pos += len(chunk)
            finally:
                body.close()
            if pos <= end:
                raise _ShortBody(f"body ended at byte {pos} of {end + 1}")
        except _transient() as err:
            failures += 1
            if failures > retries:
                raise RuntimeError(redact(
                    f"s3://{bucket}/{obj.key} (endpoint {client.meta.endpoint_url}): the "
                    f"connection dropped {failures} times ({type(err).__name__}), gave up at "
                    f"byte {pos} of {obj.size}; raise retries or check the network")) from None
            time.sleep(min(5.0, 0.1 * 2 ** (failures - 1)))  # backoff: let a flapping link settle
        except Exception as err:
            from botocore.exceptions import ClientError, FlexibleChecksumError

            if isinstance(err, ClientError):
                raise remote_error(err, f"s3://{bucket}/{obj.key}", client) from None
            if isinstance(err, FlexibleChecksumError):  # checked at the end: the range is bad
                raise _Mismatch(f"the server's checksum: {err}") from None
            raise
