"""Object-store pull vs local disk read: what a training start pays to get its dataset.

`measure(cfg)` pulls a sample of whole objects spread over their sizes (a one-object source: byte
ranges spread over it), as large as cfg.budget_s and cfg.sample_mb allow (diag.storage.sample),
with boto3's defaults, boto3 tuned from object size and core count and s5cmd (when installed; it
pulls whole objects only: beside ranges its row says so), and reads the sample's copy with a cold
and a warm page cache; with cfg.land, `land()` of the whole dataset, miss then hit. One row per
measurement (method, source, cache_state, bytes, seconds, mb_per_s, ttfb_s, repeat,
resident_fraction: the share of the local copy in the page cache when its timed read began,
measured with mincore, beside the cold/warm label; extrapolated_s: the whole dataset's pull at that
pace, and what was sampled of it); warm-up repeats are not reported. `run_storage(cfg)` adds the
re-pull tax at the whole dataset's size and the advice (diag.storage.tax).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.config import STORAGE_PULLS as PULLS
from diag.decision import Decision, MeasuredOn
from diag.runner import quietly
from diag.secrets import redact, register
from diag.storage.landing import check_free, land, local_paths
from diag.storage.methods import RANGED, pull, read_local, s5cmd_path, ttfb
from diag.storage.objectstore import (MB, RemoteObject, S3Url, list_remote, parse_url,
                                      remote_error, source_client)
from diag.storage.sample import RANGE_SAMPLE_AT_LEAST, Extrapolation, probe, ranges, spread
from diag.storage.tax import NVME_COLD, advice, over_rounds, storage_tax
from diag.timing import median_seconds

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import StorageConfig

COLUMNS = ["method", "source", "cache_state", "bytes", "seconds", "mb_per_s", "ttfb_s", "repeat",
           "files", "detail", "resident_fraction", "extrapolated_s", "dataset_bytes",
           "dataset_files", "sampled", "local_disk"]


@dataclass(frozen=True)
class StorageResult:
    """What `run_storage` returns: the measurements, the re-pull tax, the advice rows."""

    frame: pd.DataFrame  # one row per timed repeat (see the module docstring)
    tax: pd.DataFrame  # per pull method: seconds, hours and money per start and per week
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence (for amdahl.findings)
    decisions: tuple[Decision, ...] = ()  # fetch: land() once or pull per start (decide)
    sample: pd.DataFrame | None = None  # the probe: one row per sampled object, in pull order


def decide(frame: pd.DataFrame | None) -> tuple[Decision, ...]:
    """`fetch`: "land" when a verified land() hit beats the boto3-default pull per start; the
    documented default ("land") when the frame lacks either side. The pull is the whole
    dataset's, extrapolated from the sample's pulls; the hit is land()'s measured one (--land),
    else a cold read of every byte at the sample's cold local rate (what verify="sha256" does)."""
    pull_s = _median(frame, "extrapolated_s", method="boto3_default")
    if pull_s is None:
        pull_s = median_seconds(frame, method="boto3_default")
    hit_s, how = median_seconds(frame, method="land", cache_state="hit"), "land() hit"
    if hit_s is None and pull_s is not None:
        cold = frame[(frame["method"] == "local_read")
                     & frame["cache_state"].str.startswith("cold")]
        if not cold.empty and "dataset_bytes" in frame.columns:
            rate = float(cold["mb_per_s"].median())
            hit_s = float(frame["dataset_bytes"].max()) / MB / rate
            how = f"land() hit (estimated: every byte read cold at {rate:.4g} MB/s)"
    if pull_s is None or hit_s is None:
        why = ("storage frame absent" if frame is None or frame.empty else
               "no boto3_default pull or local read row ran")
        return (Decision.default("fetch", "land", f"{why}: land() once, reuse the copy",
                                 source="storage"),)
    cold_read = (frame["method"] == "local_read") & frame["cache_state"].str.startswith("cold")
    rows = frame[(frame["method"] == "boto3_default") | cold_read
                 | ((frame["method"] == "land") & (frame["cache_state"] == "hit"))]
    choice = "land" if hit_s < pull_s else "pull"
    sampled = _first(frame, "sampled")
    pulls = rows[rows["method"] == "boto3_default"]
    per_round = pulls["extrapolated_s"] if "extrapolated_s" in pulls else pulls["seconds"]
    return (Decision.from_rows(
        "fetch", choice, f"{how} {hit_s:.3g} s vs boto3 default pull {pull_s:.3g} s per "
        f"start ({over_rounds(list(per_round.dropna()))}) -> {choice}", rows, source="storage",
        measured_on=MeasuredOn(step=f"the fetch of {_first(frame, 'source') or 'the source'}"
                               + (f": {sampled}" if sampled else ""), device="this machine"),
        baseline="pull", stage="fetch_data", per="start", baseline_s=pull_s,
        chosen_s=hit_s if choice == "land" else pull_s),)


def _first(frame: pd.DataFrame, column: str) -> str:
    """The column's first figure as text ("" when absent)."""
    values = frame[column].dropna() if column in frame.columns else ()
    return str(values.iloc[0]) if len(values) else ""


def _median(frame: pd.DataFrame | None, column: str, **match: str) -> float | None:
    """median_seconds of another column (None: no such column, or no row has a figure)."""
    if frame is None or column not in frame.columns:
        return None
    return median_seconds(frame[frame[column].notna()].assign(seconds=frame[column]), **match)


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


def _landed_files(url: S3Url, root: Path) -> list[Path]:
    """The data files land() put under root (not its manifest or lock)."""
    landed, _ = local_paths(url, root)
    return [landed] if landed.is_file() else sorted(p for p in landed.rglob("*") if p.is_file())


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


@quietly
def run_storage(cfg: StorageConfig | None = None) -> StorageResult:
    """The measurements, the re-pull tax at cfg's dataset size and price, and the advice."""
    from diag.config import StorageConfig

    cfg = cfg or StorageConfig.default()
    frame, sample = measure(cfg)
    tax = storage_tax(frame, cfg.dataset_gb, cfg.runs_per_week, cfg.usd_per_hour)
    return StorageResult(frame, tax, advice(tax, frame), decide(frame), sample)


def measure(cfg: StorageConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each method's pulls of a sample of whole objects, or of byte ranges of a one-object source
    (all of it when cfg.budget_s and cfg.sample_mb allow), reads of the sample from local disk cold
    and warm, and with cfg.land land() of the whole dataset, miss then hit: (one row per timed
    repeat, the probe's rows)."""
    import pandas as pd

    from diag.config import diag_home
    from diag.machine.disks import disk_kind, is_network

    local_dir = Path(cfg.local_dir).expanduser() if cfg.local_dir else diag_home() / "storage"
    work = local_dir / f"diag-storage-{os.getpid()}"
    methods = [m for m in PULLS if m != "s5cmd" or s5cmd_path()]
    rounds = range(-cfg.warmup, cfg.repeats)
    try:
        with open_source(cfg) as (source, client, env):
            url = parse_url(source)
            objects = list_remote(client, url)
            # 85% of the budget for the probe, each method's pull in every round and each
            # round's local reads of the sample (counted as one more pull: a cold read is no
            # slower than a pull here); the rest is the listing, the TTFBs, the warm reads
            per_pull = 0.85 * cfg.budget_s / (1 + len(rounds) * (len(methods) + 1))
            sample, fit, chosen = _probe(cfg, client, url, objects, local_dir, work / "sample",
                                         per_pull)
            rows = []
            if not isinstance(chosen[0], RemoteObject):  # ranges: s5cmd takes whole objects
                rows = [_skipped(m, source, fit) for m in methods if m not in RANGED]
                methods = [m for m in methods if m in RANGED]
            rows += _pulls(client, url, source, chosen, methods, rounds, work, env, fit.factor)
            if cfg.land:  # the whole dataset: one landed copy at a time beside the sample
                check_free(local_dir, fit.dataset_bytes + 2 * fit.sample_bytes, url)
                rows += _landings(cfg, client, source, url, rounds, work, len(objects))
            paths = sorted(p for p in (work / "sample").rglob("*") if p.is_file())
            kind = disk_kind(work / "sample")
            if is_network(kind):  # the same bytes read from a local NVMe, when the box has one
                rows += _nvme_reads(paths, rounds, len(chosen))
            rows += _local_reads(paths, rounds, len(chosen), str(local_dir), kind)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for row in rows:  # what the landing folder is on (EBS, PD, NFS...: tax.advice says so)
        row.setdefault("local_disk", kind)
        row.update(dataset_bytes=fit.dataset_bytes, dataset_files=fit.dataset_files,
                   sampled=fit.label())
    return pd.DataFrame(rows, columns=COLUMNS), sample


def _probe(cfg: StorageConfig, client: Any, url: S3Url, objects: list[RemoteObject],
           local_dir: Path, dest: Path, seconds: float
           ) -> tuple[pd.DataFrame, Extrapolation, list[Any]]:
    """The sample: objects spread over the sizes (one object: its ranges spread over it) pulled
    one after another (boto3's defaults, the slowest method, so the others' pulls of it take no
    longer) until `seconds` or cfg.sample_mb; the copy stays in dest for the local reads. Free
    disk is checked before each piece for what is written: this copy and one method's pull of
    it. (probe rows, the fit, what each method pulls: the sampled objects or ranges, or the one
    object whole when every range of it was pulled)."""

    def pull_one(obj: RemoteObject, before: int) -> None:
        check_free(local_dir, 2 * (before + obj.size), url)
        try:
            pull("boto3_default", client, url, [obj], dest)
        except Exception as err:
            raise remote_error(err, url, client) from None

    one = len(objects) == 1 and objects[0].size > 0  # (an empty object has no range)
    pieces = ranges(objects[0]) if one else objects
    order = spread(pieces)
    sample = probe(order, pull_one, seconds, int(cfg.sample_mb * MB),
                   RANGE_SAMPLE_AT_LEAST if one else 0)
    fit = Extrapolation.fit(sample, sum(o.size for o in objects), len(objects),
                            pieces[0].size if one else 0)
    pulled = {id(p) for p in order[:len(sample)]}
    return sample, fit, objects if fit.whole else [p for p in pieces if id(p) in pulled]


def _skipped(method: str, source: str, fit: Extrapolation) -> dict[str, Any]:
    """The row of a method that cannot pull the sample (s5cmd, ranges): why, no figures."""
    return {**_row(method, source, "remote", 0, float("nan"), float("nan"), -1, 0,
                   f"not measured: {method} pulls whole objects only (cp and cat take no byte "
                   f"range) and the one object's {fit.dataset_bytes / MB:.4g} MB is more than "
                   "this step's share or --sample-mb allows"), "mb_per_s": float("nan")}


def _pulls(client: Any, url: S3Url, source: str, chosen: list[RemoteObject], methods: list[str],
           rounds: range, work: Path, env: dict[str, str], factor: float
           ) -> list[dict[str, Any]]:
    """Each method's pull of the sample per round, the order alternating so that drift (server
    cache, thermal, neighbours) hits all alike; warm-up rounds (r < 0) are not reported.
    extrapolated_s: the whole dataset's pull at this pull's pace (sample.Extrapolation)."""
    from tqdm.auto import tqdm

    rows, nbytes = [], sum(o.size for o in chosen)
    for r in tqdm(rounds, desc="storage", unit="round", leave=False):
        for method in (methods if r % 2 == 0 else methods[::-1]):
            # s5cmd's requests are not visible from here: its row gets no TTFB
            first = ttfb(client, url, chosen[0].key) if method != "s5cmd" else float("nan")
            start = time.perf_counter()
            try:
                detail = pull(method, client, url, chosen, work / method, env)
            except Exception as err:
                if isinstance(err, (RuntimeError, ValueError)):
                    raise
                raise remote_error(err, url, client) from None
            seconds = time.perf_counter() - start
            shutil.rmtree(work / method)
            if r >= 0:
                rows.append({**_row(method, source, "remote", nbytes, seconds, first, r,
                                    len(chosen), detail), "extrapolated_s": seconds * factor})
    return rows


def _landings(cfg: StorageConfig, client: Any, source: str, url: S3Url, rounds: range,
              work: Path, files: int) -> list[dict[str, Any]]:
    """--land: land() of the whole dataset per round, a miss into an empty folder, then a hit
    that reads nothing remote, timed on a copy evicted from the page cache (a job start on a
    node that ran other work since reads it from disk)."""
    from diag.machine.disks import evict_page_cache

    rows = []
    for r in rounds:
        shutil.rmtree(work / "landed", ignore_errors=True)
        miss = land(source, work / "landed", client=client, verify=cfg.verify,
                    retries=cfg.retries)
        cache = evict_page_cache(_landed_files(url, work / "landed"))
        resident = _resident(_landed_files(url, work / "landed"))
        hit = land(source, work / "landed", client=client, verify=cfg.verify, retries=cfg.retries)
        if r >= 0:
            rows.append(_row("land", source, "hit" if miss.hit else "miss", miss.bytes,
                             miss.seconds, float("nan"), r, files, f"verify={cfg.verify}"))
            # "hit" is the cold hit diagnose and tax_advice use; never called cold if not
            state = "hit" if cache.startswith("cold") else "hit (page cache warm)"
            rows.append(_row("land", source, state if hit.hit else "miss", hit.bytes,
                             hit.seconds, float("nan"), r, files,
                             f"verify={cfg.verify}, page cache {cache}", resident))
    shutil.rmtree(work / "landed", ignore_errors=True)
    return rows


def _local_reads(paths: list[Path], rounds: range, files: int, where: str, kind: str
                 ) -> list[dict[str, Any]]:
    """The sample's copy read sequentially, cold and warm in alternating order per round."""
    from diag.machine.disks import evict_page_cache, resident_fraction

    rows = []
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
                rows.append(_row("local_read", where, label, got, seconds, first, r, files,
                                 f"disk: {kind}, 1 MiB reads", resident))
    return rows


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
