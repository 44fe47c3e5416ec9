"""The tax of re-pulling a dataset on every start (`storage_tax`: time and money per start and
week), and the `advice` rows amdahl.findings ranks: land once, the tuned transfer to paste.
"""

from __future__ import annotations

import statistics

import pandas as pd

from diag.decision import ADVICE, FIXES
from diag.storage.sample import NVME_COLD, PULLS
from diag.storage.objectstore import MB, transfer_plan

_NETWORK_KINDS = {"network_block": "network block storage (EBS, PD, ...)",
                  "network_file": "a network filesystem (NFS, EFS, Filestore, Lustre, FUSE, ...)"}
# what each disk kind (diag.machine.disks, as `diag info` names it) is called in the advice
_DISK_WORDS = {"local_nvme": "local NVMe", "local_ssd": "a local SSD", "local_hdd": "a local HDD",
               "virtual": "a virtual disk (its backing is not visible from the guest: diag "
                          "info's disk rows)", "other": "a disk of unknown kind", **_NETWORK_KINDS}


def medians(frame: pd.DataFrame) -> pd.DataFrame:
    """Median seconds, MB/s and TTFB per method and cache state, with the repeat count."""
    return frame.groupby(["method", "cache_state"], sort=False).agg(
        bytes=("bytes", "max"), seconds=("seconds", "median"), mb_per_s=("mb_per_s", "median"),
        ttfb_s=("ttfb_s", "median"), repeats=("repeat", "count")).reset_index()


def cold_reads(frame: pd.DataFrame) -> pd.DataFrame:
    """The local reads of a copy evicted from the page cache (not the NVMe's beside it)."""
    return frame[(frame["method"] == "local_read") & frame["cache_state"].str.startswith("cold")]


def storage_tax(frame: pd.DataFrame, dataset_gb: float | None = None, runs_per_week: float = 20.0,
                usd_per_hour: float | None = None) -> pd.DataFrame:
    """Each pull method's cost per start (dataset_gb 0: measured size; usd_per_hour 0: no money)."""
    pulls = frame[frame["method"].isin(PULLS)]
    if pulls.empty:
        raise ValueError("frame has no pull rows (method in " + ", ".join(PULLS) + "): "
                         "pass the frame run_storage returned")
    if runs_per_week < 0 or (usd_per_hour or 0) < 0 or (dataset_gb or 0) < 0:
        raise ValueError(f"dataset_gb={dataset_gb!r}, runs_per_week={runs_per_week!r}, "
                         f"usd_per_hour={usd_per_hour!r}: each must be >= 0")
    skipped = pulls[pulls["mb_per_s"].isna()]  # a method that cannot pull the sample: why
    pulls = pulls[pulls["mb_per_s"].notna()]
    measured_gb = float(pulls["bytes"].max()) / 1e9
    listed = pulls["dataset_bytes"].max() if "dataset_bytes" in pulls.columns else float("nan")
    whole_gb = float(listed) / 1e9 if listed == listed else measured_gb
    gb = dataset_gb or whole_gb
    rows = []
    for method, part in pulls.groupby("method", sort=False):
        rate = statistics.median(part["mb_per_s"])
        # each round's whole pull extrapolated from the sample (else its rate), at dataset_gb
        whole = [s * gb / whole_gb for s in part.get("extrapolated_s", ()) if s == s] or \
            [gb * 1000 / r for r in part["mb_per_s"]]
        per_run = statistics.median(whole)
        usd = per_run / 3600 * usd_per_hour if usd_per_hour else float("nan")
        sampled = (f" (extrapolated from {part['sampled'].iloc[0]})"
                   if whole_gb > measured_gb and "sampled" in part.columns else "")
        rows.append({
            "method": method, "mb_per_s": rate, "repeats": len(part), "dataset_gb": gb,
            "measured_gb": measured_gb, "seconds_per_run": per_run, "seconds_low": min(whole),
            "seconds_high": max(whole), "runs_per_week": runs_per_week,
            "hours_per_week": per_run * runs_per_week / 3600, "usd_per_run": usd,
            "usd_per_week": usd * runs_per_week,
            "evidence": f"{gb:.3g} GB at {rate:.0f} MB/s ({method}, measured on "
                        f"{measured_gb * 1000:.4g} MB) = {_duration(per_run)} per start "
                        f"({over_rounds(whole)}){sampled}"})
    rows += [{"method": r.method, "repeats": 0, "dataset_gb": gb, "evidence": r.detail,
              "runs_per_week": runs_per_week} for r in skipped.itertuples()]
    return pd.DataFrame(rows)


def over_rounds(seconds: list[float]) -> str:
    """The spread of one estimate per round: "median of 3 rounds, 2.0-2.3 min" ("1 round")."""
    if len(seconds) <= 1:
        return f"{len(seconds)} round"
    low, high = _duration(min(seconds)), _duration(max(seconds))
    if low.split()[-1] == high.split()[-1]:  # one unit: "2.0-2.3 min"
        low = low.split()[0]
    return f"median of {len(seconds)} rounds, {low}-{high}"


def advice(tax: pd.DataFrame, frame: pd.DataFrame) -> pd.DataFrame:
    """Land once (saving net of a measured hit, else a cold read), and tune the pull."""
    by = tax[tax["seconds_per_run"].notna()].set_index("method")
    if by.empty:  # a local source: nothing pulled
        return pd.DataFrame(columns=ADVICE)
    base = by.loc["boto3_default"] if "boto3_default" in by.index else by.iloc[0]
    gb, hit_s, hit_note = base["dataset_gb"], 0.0, ""
    hits = frame[(frame["method"] == "land") & (frame["cache_state"] == "hit")]
    if not hits.empty:
        measured = statistics.median(hits["seconds"])
        hit_s = measured * gb * 1e9 / float(hits["bytes"].max())
        detail = hits["detail"].iloc[0] if "detail" in hits else ""
        detail = f", {detail}" if detail else ""
        hit_note = (f"; a land() hit still takes {_duration(hit_s)} (measured {measured:.3g} s "
                    f"on {hits['bytes'].max() / MB:.0f} MB, median of {len(hits)}{detail})")
    elif not (cold := cold_reads(frame)).empty:
        rate = statistics.median(cold["mb_per_s"])
        hit_s = gb * 1000 / rate
        hit_note = f"; a verified hit reads it once from local disk at {rate:.0f} MB/s (cold)"
    disk = ""  # ": measured into <the landing folder>, on <its kind>", from the local reads
    reads = frame[(frame["method"] == "local_read") & ~frame["cache_state"].eq(NVME_COLD)]
    if "local_disk" in frame and not reads.empty:
        kind = str(reads["local_disk"].iloc[0])
        disk = f": measured into {reads['source'].iloc[0]}, on {_DISK_WORDS.get(kind, kind)}"
    rows = [{"stage": "fetch_data",
             "finding": f"{FIXES['fetch_data']}{disk}; or with `s5cmd sync` / "
                        "`aws s3 sync` to that disk, Mountpoint for S3 with its local cache "
                        "`mount-s3 --cache DIR`, FSx for Lustre linked to the bucket",
             "seconds_saved": max(0.0, base["seconds_per_run"] - hit_s),
             "evidence": base["evidence"] + hit_note}, *landing_disk_advice(frame, gb)]
    # the dataset's objects: the listing's count (the sample's pieces in an older frame)
    files = frame.get("dataset_files", frame.get("files"))
    files = int(files.max()) if files is not None and files.notna().any() else 1
    if "boto3_tuned" in by.index and base.name != "boto3_tuned" and \
            by.loc["boto3_tuned", "seconds_per_run"] < 0.9 * base["seconds_per_run"]:
        tuned, plan = by.loc["boto3_tuned"], transfer_plan(int(gb * 1e9 / max(1, files)))
        mib = max(5, round(plan.part_bytes / 2**20))
        rows.append({"stage": "fetch_data", "seconds_saved": base["seconds_per_run"]
                     - tuned["seconds_per_run"], "evidence": f"{tuned['evidence']} vs "
                     f"{base['evidence']}", "finding": "if it must be pulled: tune the transfer "
                     f"(diag.storage.transfer_plan): boto3 `TransferConfig(multipart_threshold="
                     f"{plan.single_get_below}, multipart_chunksize={plan.part_bytes}, "
                     f"max_concurrency={plan.concurrency})`; aws CLI, in ~/.aws/config under your"
                     f" profile: `s3 =` / `  max_concurrent_requests = {plan.concurrency}` / "
                     f"`  multipart_threshold = {plan.single_get_below // MB}MB` / "
                     f"`  multipart_chunksize = {plan.part_bytes // MB}MB`; s5cmd: `s5cmd "
                     f"--numworkers {plan.concurrency} cp --concurrency {plan.concurrency} "
                     f"--part-size {mib}`"})
    return pd.DataFrame(rows, columns=ADVICE)


def landing_disk_advice(frame: pd.DataFrame, dataset_gb: float) -> list[dict[str, object]]:
    """A row for a landing folder on network storage: its cold rate beside a local NVMe's."""
    if "local_disk" not in frame:
        return []
    here = cold_reads(frame)
    here = here[here["local_disk"].isin(list(_NETWORK_KINDS))]
    if here.empty:
        return []
    kind, folder = here["local_disk"].iloc[0], here["source"].iloc[0]
    rate = statistics.median(here["mb_per_s"])
    per_start = dataset_gb * 1000 / rate
    evidence = (f"local_read cold from {folder} ({kind}): {rate:.0f} MB/s, median of {len(here)}"
                f" = {_duration(per_start)} to read {dataset_gb:.3g} GB once")
    nvme = frame[frame["cache_state"] == NVME_COLD]
    if nvme.empty:
        saved = per_start  # no local disk measured: the network read itself, an upper bound
        where = "local NVMe (instance store / local SSD; none was found on this machine)"
    else:
        fast = statistics.median(nvme["mb_per_s"])
        saved = max(0.0, per_start - dataset_gb * 1000 / fast)
        where = f"the local NVMe at {nvme['source'].iloc[0]}"
        evidence += (f"; the same bytes from {nvme['source'].iloc[0]} (local_nvme): {fast:.0f} "
                     f"MB/s cold, median of {len(nvme)}")
    return [{"stage": "fetch_data", "seconds_saved": saved, "evidence": evidence,
             "finding": f"the landing folder {folder} is on {_NETWORK_KINDS[kind]}, not local "
                        f"disk: each cold start reads the landed copy over the network; land "
                        f"it on {where} (--local-dir)"}]


def _duration(seconds: float) -> str:
    return (f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min"
            if seconds >= 90 else f"{seconds:.2g} s")
