"""The landing disk judged: a landing folder on network block storage (EBS, PD) or a network
filesystem is said in the storage advice, with its measured cold read rate beside a local NVMe's
when the machine has one (the rule on constructed frames; the measurement on the embedded S3
server, with the disk classification of the landing folder and of a local NVMe given)."""

from __future__ import annotations

import pandas as pd
import pytest

from diag.config import StorageConfig
from diag.machine.disks import Disk
from diag.storage import experiment, run_storage
from diag.storage.experiment import NVME_COLD
from diag.storage.tax import advice, landing_disk_advice, storage_tax


def reads(kind: str, rates: list[float], nvme: list[float]) -> pd.DataFrame:
    rows = [{"method": "local_read", "source": "/data/landing", "cache_state": "cold",
             "mb_per_s": r, "local_disk": kind} for r in rates]
    rows += [{"method": "local_read", "source": "/data/landing", "cache_state": "warm",
              "mb_per_s": 5000.0, "local_disk": kind}]
    rows += [{"method": "local_read", "source": "/mnt/nvme", "cache_state": NVME_COLD,
              "mb_per_s": r, "local_disk": "local_nvme"} for r in nvme]
    return pd.DataFrame(rows)


def test_a_network_block_landing_folder_is_said_with_the_nvme_rate_beside_it():
    [row] = landing_disk_advice(reads("network_block", [120.0, 125.0, 130.0], [2000.0, 2500.0]),
                                dataset_gb=25.0)
    assert "/data/landing is on network block storage (EBS, PD" in row["finding"]
    assert "the local NVMe at /mnt/nvme" in row["finding"]
    assert "125 MB/s, median of 3" in row["evidence"] and "2250 MB/s cold" in row["evidence"]
    assert row["seconds_saved"] == pytest.approx(25_000 / 125 - 25_000 / 2250)


def test_a_network_filesystem_without_local_nvme_gets_the_upper_bound():
    [row] = landing_disk_advice(reads("network_file", [80.0], []), dataset_gb=8.0)
    assert "a network filesystem" in row["finding"] and "none was found" in row["finding"]
    assert row["seconds_saved"] == pytest.approx(8_000 / 80)


@pytest.mark.parametrize("kind", ["local_nvme", "local_ssd", "other"])
def test_a_local_landing_folder_gets_no_such_row(kind):
    assert landing_disk_advice(reads(kind, [2000.0], []), dataset_gb=8.0) == []


@pytest.mark.parametrize("kind, named", [
    ("virtual", "on a virtual disk (its backing is not visible"), ("local_nvme", "on local NVMe"),
    ("network_block", "on network block storage")])
def test_the_landing_advice_names_the_disk_it_measured(kind, named):
    pulls = pd.DataFrame([{"method": "boto3_default", "source": "s3://b/k", "cache_state": "remote",
                           "bytes": 10**8, "mb_per_s": 50.0, "repeat": 0, "local_disk": kind}])
    frame = pd.concat([pulls, reads(kind, [900.0], [])], ignore_index=True)
    row = advice(storage_tax(pulls), frame).iloc[0]
    assert row["stage"] == "fetch_data" and row["finding"].startswith("land the dataset once")
    assert f"measured into /data/landing, {named}" in row["finding"]
    assert ("NVMe" in row["finding"]) == (kind == "local_nvme")  # never advised blind to the disk


def test_measure_reads_a_local_nvme_beside_a_network_landing_folder(tmp_path, monkeypatch):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    landing = tmp_path / "landing"
    # this machine's disks are what they are: the landing folder is given as EBS, and a folder
    # of this disk as a local NVMe mount (diag.machine.disks' classification: test_disks)
    monkeypatch.setattr("diag.machine.disks.disk_kind", lambda path, *a, **k: "network_block")
    monkeypatch.setattr("diag.machine.disks.disks", lambda *a, **k: [
        Disk(str(nvme), "/dev/nvme1n1", "ext4", "local_nvme", "nvme1n1: instance store")])
    cfg = StorageConfig.quick(local_dir=str(landing), repeats=1, warmup=0, size_mb=4.0)
    result = run_storage(cfg)
    frame = result.frame
    near = frame[frame["cache_state"] == NVME_COLD]
    assert len(near) == 1 and near["source"].iloc[0] == str(nvme)
    assert near["bytes"].iloc[0] == frame[frame["method"] == "local_read"]["bytes"].max()
    assert set(frame.loc[frame["cache_state"] != NVME_COLD, "local_disk"]) == {"network_block"}
    found = result.advice[result.advice["finding"].str.contains("is on network block storage")]
    assert len(found) == 1 and f"the local NVMe at {nvme}" in found["finding"].iloc[0]
    assert list(nvme.iterdir()) == []  # the copy on the NVMe is removed
    assert experiment.COLUMNS[-1] == "local_disk"
