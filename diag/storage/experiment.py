"""Object-store pull vs local disk read: `measure(cfg)` pulls a sample spread over the objects'
sizes with each method and reads the copy cold and warm; `run_storage(cfg)` adds the tax, advice.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from diag.config import StorageConfig, diag_home
from diag.config.source import HubUrl, LocalUrl, S3Url, data_file, parse_url
from diag.decision import Decision, MeasuredOn
from diag.files import scratch_folder
from diag.machine import disks
from diag.runner import quietly
from diag.secrets import redact, register
from diag.storage.landing import check_free, land
from diag.storage.objectstore import MB, RemoteObject, deadline, deadline_s, source_client
from diag.storage.sample import (NVME_COLD, PULLS, RANGE_SAMPLE_AT_LEAST, RANGED,  # noqa: F401
                                 Extrapolation, local_reads, nvme_reads, probe, pull, ranges,
                                 read_local, row, s5cmd_path, spread)
from diag.storage.sources import list_remote
from diag.storage.tax import advice, cold_reads, over_rounds, storage_tax
from diag.timing import median_seconds

COLUMNS = ["method", "source", "cache_state", "bytes", "seconds", "mb_per_s", "ttfb_s", "repeat",
           "files", "detail", "resident_fraction", "extrapolated_s", "dataset_bytes",
           "dataset_files", "sampled", "local_disk"]


@dataclass(frozen=True)
class StorageResult:
    frame: pd.DataFrame  # one row per timed repeat (COLUMNS)
    tax: pd.DataFrame  # per pull method: seconds, hours and money per start and per week
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence (for amdahl.findings)
    decisions: tuple[Decision, ...] = ()  # fetch: land() once or pull per start (decide)
    sample: pd.DataFrame | None = None  # the probe: one row per sampled object, in pull order


def decide(frame: pd.DataFrame | None) -> tuple[Decision, ...]:
    """`fetch`: "land" when a land() hit beats the first method's pull per start, or no figure."""
    def default(why: str) -> tuple[Decision, ...]:
        return (Decision.default("fetch", "land", why, source="storage"),)

    if frame is None or frame.empty:
        return default("storage frame absent: land() once, reuse the copy")
    if not frame["method"].isin(PULLS).any():
        return default("the source is on this machine: nothing to pull or land, read where it is")
    base = next(m for m in PULLS if (frame["method"] == m).any())
    pulls = frame[frame["method"] == base]
    whole = "extrapolated_s" in pulls and pulls["extrapolated_s"].notna().any()
    per_round = list(pulls["extrapolated_s" if whole else "seconds"].dropna())
    hit_s, how = median_seconds(frame, method="land", cache_state="hit"), "land() hit"
    cold = cold_reads(frame)
    if hit_s is None and not cold.empty and "dataset_bytes" in frame:
        rate = float(cold["mb_per_s"].median())
        hit_s = float(frame["dataset_bytes"].max()) / MB / rate
        how = f"land() hit (estimated: every byte read cold at {rate:.4g} MB/s)"
    if not per_round or hit_s is None:
        return default("no pull or local read row ran: land() once, reuse the copy")
    pull_s = statistics.median(per_round)
    choice, sampled = "land" if hit_s < pull_s else "pull", _first(frame, "sampled")
    rows = frame[(frame["method"] == base) | frame.index.isin(cold.index)
                 | ((frame["method"] == "land") & (frame["cache_state"] == "hit"))]
    return (Decision.from_rows(
        "fetch", choice, f"{how} {hit_s:.3g} s vs {base} pull {pull_s:.3g} s per start "
        f"({over_rounds(per_round)}) -> {choice}", rows, source="storage",
        measured_on=MeasuredOn(step=f"the fetch of {_first(frame, 'source') or 'the source'}"
                               + (f": {sampled}" if sampled else ""), device="this machine"),
        baseline="pull", stage="fetch_data", per="start", baseline_s=pull_s,
        chosen_s=hit_s if choice == "land" else pull_s),)


def _first(frame: pd.DataFrame, column: str) -> str:
    """The column's first figure as text ("" when absent)."""
    values = frame[column].dropna() if column in frame.columns else ()
    return str(values.iloc[0]) if len(values) else ""


@contextlib.contextmanager
def open_source(cfg: StorageConfig) -> Iterator[tuple[str, Any, dict[str, str]]]:
    """(url, client, env for s5cmd): the user's source, or the embedded server with a dataset."""
    if cfg.source:  # s5cmd reads the same settings from the environment
        yield cfg.source, source_client(cfg), {**os.environ, **{name: value for name, value in (
            ("AWS_ENDPOINT_URL", cfg.endpoint_url), ("AWS_PROFILE", cfg.profile),
            ("AWS_REGION", cfg.region)) if value}}
        return
    from diag.embedded import S3Server, embedded_dataset

    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):  # boto3 would honour it for a --source; here there is none
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


@quietly
def run_storage(cfg: StorageConfig | None = None) -> StorageResult:
    """The measurements, the re-pull tax at cfg's dataset size and price, and the advice."""
    cfg = cfg or StorageConfig.default()
    frame, sample = measure(cfg)
    tax = (storage_tax(frame, cfg.dataset_gb, cfg.runs_per_week, cfg.usd_per_hour)
           if frame["method"].isin(PULLS).any()  # a local source: no pull, no tax, no advice
           else pd.DataFrame(columns=["method", "seconds_per_run"]))
    return StorageResult(frame, tax, advice(tax, frame), decide(frame), sample)


def measure(cfg: StorageConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rows per timed repeat: pulls, cfg.land's land() miss then hit, local reads; the probe)."""
    local_dir = Path(cfg.local_dir).expanduser() if cfg.local_dir else diag_home() / "storage"
    work = scratch_folder("diag-storage", local_dir)  # a killed run's: swept at the next start
    rounds = range(-cfg.warmup, cfg.repeats)
    try:
        with open_source(cfg) as (source, client, env):
            url = parse_url(source)
            local = isinstance(url, LocalUrl)
            objects = [o for o in list_remote(client, url) if not local or data_file(o.key)]
            methods = (["hf_hub"] if isinstance(url, HubUrl) else [] if local
                       else [m for m in PULLS if m in RANGED or m == "s5cmd" and s5cmd_path()])
            # 85% of the budget: the probe, each round's pulls and reads; the rest: list, TTFB, warm
            per_pull = 0.85 * cfg.budget_s / (1 + len(rounds) * (len(methods) + 1))
            sample, fit, chosen = _probe(cfg, client, url, objects, local_dir, work / "sample",
                                         per_pull)
            whole = isinstance(chosen[0], RemoteObject)  # else ranges: s5cmd takes whole objects
            rows = [row(m, source, "remote", 0, float("nan"), float("nan"), -1, 0,
                        f"not measured: {m} pulls whole objects only (cp and cat take no byte "
                        f"range) and the one object's {fit.dataset_bytes / MB:.4g} MB is more "
                        "than this step's share or --sample-mb allows")
                    for m in methods if not whole and m not in RANGED]
            methods = [m for m in methods if whole or m in RANGED]
            rows += _pulls(client, url, source, chosen, methods, rounds, work, env, fit, cfg)
            if cfg.land and isinstance(url, S3Url):  # one landed copy at a time beside the sample
                check_free(local_dir, fit.dataset_bytes + 2 * fit.sample_bytes, url)
                with deadline(client, len(rounds) * 2 * deadline_s(
                        fit.dataset_bytes, fit.bytes_per_s / MB, cfg.stall_s), source):
                    rows += _landings(cfg, client, source, rounds, work)
            paths = [Path(o.key) for o in chosen] if local else sorted(
                p for p in (work / "sample").rglob("*") if p.is_file())
            kind = disks.disk_kind(paths[0] if local else work / "sample")
            if disks.is_network(kind):  # the same bytes read from a local NVMe, if there is one
                rows += nvme_reads(paths, rounds, len(chosen))
            where = str(url.path.parent if local and not url.is_prefix else url.path if local
                        else local_dir)
            rows += local_reads(paths, rounds, len(chosen), where, kind)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    frame = pd.DataFrame([{"local_disk": kind, **one} for one in rows], columns=COLUMNS)
    return frame.assign(dataset_bytes=fit.dataset_bytes, dataset_files=fit.dataset_files,
                        sampled=fit.label()), sample  # local_disk: what tax.advice names


def _probe(cfg: StorageConfig, client: Any, url: Any, objects: list[RemoteObject],
           local_dir: Path, dest: Path, seconds: float
           ) -> tuple[pd.DataFrame, Extrapolation, list[Any]]:
    """(probe rows, the fit, what each method pulls): pieces pulled by boto3's defaults."""
    done = [0, 0.0]  # bytes and seconds pulled so far: the rate a deadline rests on

    def pull_one(obj: RemoteObject, before: int) -> None:
        if isinstance(url, LocalUrl):
            read_local([Path(obj.key)])
            return
        check_free(local_dir, 2 * (before + obj.size), url)
        start, rate = time.perf_counter(), done[0] / MB / done[1] if done[1] else None
        with deadline(client, deadline_s(obj.size, rate, cfg.stall_s), f"{url}: {obj.key}", url):
            pull("hf_hub" if isinstance(url, HubUrl) else "boto3_default", client, url, [obj], dest)
        done[0], done[1] = done[0] + obj.size, done[1] + time.perf_counter() - start

    one = isinstance(url, S3Url) and len(objects) == 1 and objects[0].size > 0
    pieces = ranges(objects[0]) if one else objects
    order = spread(pieces)
    sample = probe(order, pull_one, seconds, int(cfg.sample_mb * MB),
                   RANGE_SAMPLE_AT_LEAST if one else 0)
    fit = Extrapolation.fit(sample, sum(o.size for o in objects), len(objects),
                            pieces[0].size if one else 0)
    pulled = {id(p) for p in order[:len(sample)]}
    return sample, fit, objects if fit.whole else [p for p in pieces if id(p) in pulled]


def _pulls(client: Any, url: Any, source: str, chosen: list[RemoteObject], methods: list[str],
           rounds: range, work: Path, env: dict[str, str], fit: Extrapolation,
           cfg: StorageConfig) -> list[dict[str, Any]]:
    """Each method's pull per round in alternating order (extrapolated_s: the whole pull)."""
    from tqdm.auto import tqdm

    rows, nbytes, rate = [], sum(o.size for o in chosen), fit.bytes_per_s / MB
    for r in tqdm(rounds, desc="storage", unit="round", leave=False):
        for method in (methods if r % 2 == 0 else methods[::-1]):
            what = f"{url}: {len(chosen)} piece(s), {method}"
            with deadline(client, deadline_s(nbytes, rate, cfg.stall_s), what, url):
                start, first = time.perf_counter(), float("nan")
                if method in RANGED:  # one byte's GET; s5cmd's requests are not visible here
                    client.get_object(Bucket=url.bucket, Key=chosen[0].key,
                                      Range="bytes=0-0")["Body"].read()
                    start, first = time.perf_counter(), time.perf_counter() - start
                detail = pull(method, client, url, chosen, work / method, env,
                              deadline_s(nbytes, rate, cfg.stall_s), cfg.retries)
                seconds = time.perf_counter() - start
            shutil.rmtree(work / method)
            if r >= 0:
                rows.append({**row(method, source, "remote", nbytes, seconds, first, r,
                                   len(chosen), detail), "extrapolated_s": seconds * fit.factor})
    return rows


def _landings(cfg: StorageConfig, client: Any, source: str, rounds: range, work: Path
              ) -> list[dict[str, Any]]:
    """--land: land() per round, a miss then a hit timed on a copy evicted from the page cache."""
    rows, into = [], work / "landed"
    for r in rounds:
        shutil.rmtree(into, ignore_errors=True)
        miss = land(source, into, client=client, verify=cfg.verify, retries=cfg.retries)
        paths = [miss.path] if miss.path.is_file() else sorted(
            p for p in miss.path.rglob("*") if p.is_file())
        cache, share = disks.evict_page_cache(paths), max(map(disks.resident_fraction, paths))
        hit = land(source, into, client=client, verify=cfg.verify, retries=cfg.retries)
        if r >= 0:
            rows.append(row("land", source, "hit" if miss.hit else "miss", miss.bytes,
                            miss.seconds, float("nan"), r, miss.files, f"verify={cfg.verify}"))
            # "hit" is the cold hit diagnose and tax_advice use; never called cold if not
            state = "hit" if cache.startswith("cold") else "hit (page cache warm)"
            rows.append(row("land", source, state if hit.hit else "miss", hit.bytes,
                            hit.seconds, float("nan"), r, hit.files,
                            f"verify={cfg.verify}, page cache {cache}", share))
    shutil.rmtree(into, ignore_errors=True)
    return rows
