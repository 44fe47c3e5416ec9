"""diag.machine.disks: the kind of the filesystem under a path, and the page cache (mincore,
eviction).

Each cloud layout is a fake sysfs + mount table built the way the kernel lays them out (class/block
links into devices/, partitions inside their disk, NVMe model strings under device/), so the same
code that reads /sys on an EC2 or GCE box reads these.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diag.machine import disks

ROOT_DEV = os.stat("/").st_dev  # /dev/root is found by the st_dev of its mountpoint


def fake_machine(tmp: Path, devices: dict[str, dict], mounts: list[str]) -> tuple[str, str]:
    """A sysfs tree and a /proc/mounts file; devices: name -> model, driver, rotational, parts,
    slaves, dev (major:minor)."""
    sysfs = tmp / "sys"
    (sysfs / "class" / "block").mkdir(parents=True)
    for name, spec in devices.items():
        disk = sysfs / "devices" / name
        (disk / "queue").mkdir(parents=True)
        (disk / "queue" / "rotational").write_text(f"{spec.get('rotational', 0)}\n")
        (disk / "device").mkdir()
        if "model" in spec:
            (disk / "device" / "model").write_text(spec["model"] + "  \n")  # sysfs pads models
        if "driver" in spec:
            driver = sysfs / "bus" / "drivers" / spec["driver"]
            driver.mkdir(parents=True, exist_ok=True)
            (disk / "device" / "driver").symlink_to(driver)
        if "dev" in spec:
            (disk / "dev").write_text(spec["dev"] + "\n")
        for member in spec.get("slaves", ()):
            (disk / "slaves").mkdir(exist_ok=True)
            (disk / "slaves" / member).symlink_to(sysfs / "devices" / member)
        (sysfs / "class" / "block" / name).symlink_to(disk)
        for part, dev in spec.get("parts", {}).items():
            (disk / part).mkdir()
            (disk / part / "partition").write_text("1\n")
            (disk / part / "dev").write_text(dev + "\n")
            (sysfs / "class" / "block" / part).symlink_to(disk / part)
    table = tmp / "mounts"
    table.write_text("".join(f"{line} 0 0\n" for line in mounts))
    return str(sysfs), str(table)


ROOT = f"{os.major(ROOT_DEV)}:{os.minor(ROOT_DEV)}"
LAYOUTS = {
    # Ubuntu on EC2 Nitro: / is /dev/root (an EBS nvme), instance store on /opt/dlami/nvme
    "aws": ({"nvme0n1": {"model": "Amazon Elastic Block Store", "parts": {"nvme0n1p1": ROOT}},
             "nvme1n1": {"model": "Amazon EC2 NVMe Instance Storage"}},
            ["/dev/root / ext4 rw", "/dev/nvme1n1 /opt/dlami/nvme xfs rw",
             "tmpfs /run tmpfs rw", "proc /proc proc rw"],
            {"/": "network_block", "/opt/dlami/nvme": "local_nvme"}),
    # instance stores striped into one md RAID0, and an LVM volume on EBS
    "aws-raid": ({"nvme1n1": {"model": "Amazon EC2 NVMe Instance Storage"},
                  "nvme2n1": {"model": "Amazon EC2 NVMe Instance Storage"},
                  "md0": {"slaves": ["nvme1n1", "nvme2n1"]},
                  "nvme0n1": {"model": "Amazon Elastic Block Store"},
                  "dm-0": {"slaves": ["nvme0n1"]},
                  "dm-1": {"slaves": ["nvme0n1", "nvme1n1"]}},
                 ["/dev/md0 /scratch ext4 rw", "/dev/dm-0 /data xfs rw", "/dev/dm-1 /mixed xfs rw"],
                 {"/scratch": "local_nvme", "/data": "network_block", "/mixed": "other"}),
    "gcp-scsi": ({"sda": {"model": "PersistentDisk", "rotational": 1, "parts": {"sda1": "8:1"}},
                  "sdb": {"model": "EphemeralDisk", "rotational": 1}},
                 ["/dev/sda1 / ext4 rw", "/dev/sdb /mnt/disks/ssd0 ext4 rw"],
                 {"/": "network_block", "/mnt/disks/ssd0": "local_ssd"}),
    "gcp-nvme": ({"nvme0n1": {"model": "nvme_card-pd", "parts": {"nvme0n1p1": "259:1"}},
                  "nvme1n1": {"model": "nvme_card0"}},
                 ["/dev/nvme0n1p1 / ext4 rw", "/dev/nvme1n1 /mnt/localssd ext4 rw"],
                 {"/": "network_block", "/mnt/localssd": "local_nvme"}),
    "network-files": ({},
                      ["fs-12ab.efs.us-east-1.amazonaws.com:/ /efs nfs4 rw",
                       "10.0.0.5@tcp:/abcd /fsx lustre rw",
                       "mountpoint-s3 /mnt/s3 fuse rw", "s3fs /mnt/s3fs fuse.s3fs rw",
                       "bucket /mnt/gcs fuse.gcsfuse rw"],
                      {"/efs": "network_file", "/fsx": "network_file", "/mnt/s3": "network_file",
                       "/mnt/s3fs": "network_file", "/mnt/gcs": "network_file"}),
    "virtual": ({"vda": {"driver": "virtio_blk", "rotational": 1, "parts": {"vda1": "252:1"}}},
                ["/dev/vda1 / ext4 rw", "share /host virtiofs rw"],
                {"/": "virtual", "/host": "virtual"}),
    "bare-metal": ({"nvme0n1": {"model": "SAMSUNG MZQL23T8HCLS-00A07"},
                    "sda": {"model": "Samsung SSD 870", "rotational": 0},
                    "sdb": {"model": "ST8000NM000A", "rotational": 1},
                    "loop0": {}},
                   ["/dev/nvme0n1 / ext4 rw", "/dev/sda /ssd ext4 rw", "/dev/sdb /hdd ext4 rw",
                    "/dev/loop0 /snap/core squashfs ro", "/dev/loop0 /img ext4 rw",
                    "overlay /ctr overlay rw,upperdir=/nonexistent/upper"],
                   {"/": "local_nvme", "/ssd": "local_ssd", "/hdd": "local_hdd", "/img": "other",
                    "/ctr": "other"}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_cloud_layout_gets_its_kind_with_evidence(tmp_path: Path, layout: str) -> None:
    devices, mounts, want = LAYOUTS[layout]
    sysfs, table = fake_machine(tmp_path, devices, mounts)
    found = {d.mountpoint: d for d in disks.disks(sysfs, table)}
    assert {m: d.kind for m, d in found.items()} == want  # pseudo filesystems and squashfs left out
    for d in found.values():
        assert d.evidence and d.kind in disks.KINDS
    for mountpoint, kind in want.items():  # a path below a mount answers for that mount
        assert disks.disk_kind(mountpoint + "/x/y", sysfs, table) == kind
        assert disks.is_network(kind) == kind.startswith("network")


def test_evidence_names_the_model_and_resolves_dev_root(tmp_path: Path) -> None:
    sysfs, table = fake_machine(tmp_path, *LAYOUTS["aws"][:2])
    kind, evidence = disks.describe("/home/ubuntu", sysfs, table)
    assert kind == "network_block" and disks.is_network(kind)
    assert "/dev/root is nvme0n1p1" in evidence and "AWS EBS" in evidence
    assert "partition of nvme0n1" in evidence and "Amazon Elastic Block Store" in evidence
    assert "AWS instance store" in disks.describe("/opt/dlami/nvme", sysfs, table)[1]
    sysfs, table = fake_machine(tmp_path / "efs", *LAYOUTS["network-files"][:2])
    assert "AWS EFS" in disks.describe("/efs/data", sysfs, table)[1]
    sysfs, table = fake_machine(tmp_path / "raid", *LAYOUTS["aws-raid"][:2])
    evidence = disks.describe("/scratch", sysfs, table)[1]
    assert "md0 over nvme1n1" in evidence and "nvme2n1" in evidence


def test_dev_root_with_no_matching_device_is_other_and_says_why(tmp_path: Path) -> None:
    sysfs, table = fake_machine(tmp_path, {"nvme0n1": {"model": "Amazon Elastic Block Store",
                                                       "parts": {"nvme0n1p1": "1:99999"}}},
                                ["/dev/root / ext4 rw"])
    kind, evidence = disks.describe("/", sysfs, table)
    assert kind == "other" and "st_dev" in evidence


def test_this_machine_through_psutil(tmp_path: Path) -> None:
    assert disks.disk_kind(tmp_path) in disks.KINDS
    assert all(d.fstype not in ("proc", "sysfs", "tmpfs", "cgroup") for d in disks.disks())
    assert all(d.kind in disks.KINDS and d.evidence for d in disks.disks())


@pytest.mark.slow
def test_info_reports_a_fake_layout(tmp_path: Path) -> None:
    sysfs, table = fake_machine(tmp_path, *LAYOUTS["aws"][:2])
    out = subprocess.run([sys.executable, "-m", "diag", "info", "--no-probe"], text=True,
                         capture_output=True, timeout=120,
                         env={**os.environ, "DIAG_SYSFS": sysfs, "DIAG_MOUNTS": table})
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()
            if line.strip().startswith("disk:")}
    assert set(rows) == {"disk:/", "disk:/opt/dlami/nvme"}
    assert "network_block" in rows["disk:/"] and "local_nvme" in rows["disk:/opt/dlami/nvme"]


def test_evict_page_cache_makes_a_file_cold_and_says_so(disk_tmp_path) -> None:
    tmp_path = disk_tmp_path
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(8 << 20))
    path.read_bytes()
    assert disks.resident_fraction(path) > 0.9  # just written and read: in the page cache
    assert disks.evict_page_cache([path]) == "cold"
    assert disks.resident_fraction(path) < 0.02
    path.read_bytes()
    assert disks.resident_fraction(path) > 0.9
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert disks.resident_fraction(empty) == 0.0


# -- page cache: a folder on a disk, and evictions that fail --------------------------------------
import shutil  # noqa: E402  (kept with the tests below, so the top of the file stays as it was)
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

_RAM_FS = ("tmpfs", "ramfs")


def _fstype(path: os.PathLike[str] | str) -> str:
    real = os.path.realpath(path)
    hits = [(len(m[1]), i, m[2]) for i, m in enumerate(disks._mounts())
            if m[1] == "/" or real == m[1] or real.startswith(m[1].rstrip("/") + "/")]
    return max(hits)[2] if hits else ""


@pytest.fixture
def disk_tmp_path(tmp_path: Path) -> Iterator[Path]:
    """A temporary folder on a disk: pages of a file on tmpfs live in RAM and cannot be evicted."""
    candidates = [tmp_path, Path(tempfile.gettempdir()), Path("/var/tmp"),
                  Path(__file__).resolve().parents[2] / ".pytest_cache"]
    for base in candidates:
        if base.is_dir() and os.access(base, os.W_OK) and _fstype(base) not in _RAM_FS:
            folder = Path(tempfile.mkdtemp(prefix="diag-evict-", dir=base))
            yield folder
            shutil.rmtree(folder, ignore_errors=True)
            return
    pytest.skip("every candidate temporary folder is on tmpfs/ramfs, whose pages cannot be "
                "evicted: " + ", ".join(f"{c} ({_fstype(c)})" for c in candidates))


def _cached(path: Path, size: int = 4 << 20) -> Path:
    path.write_bytes(os.urandom(size))
    path.read_bytes()
    assert disks.resident_fraction(path) > 0.9
    return path


def test_eviction_that_does_nothing_is_labelled_warm(disk_tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _cached(disk_tmp_path / "kept.bin")
    monkeypatch.setattr(disks.os, "posix_fadvise", lambda *args: None)  # the kernel ignores us
    label = disks.evict_page_cache([path])
    assert label == "warm (eviction failed: 100% still cached)"
    assert disks.resident_fraction(path) > 0.9  # the label agrees with what mincore measures


def test_one_file_left_cached_makes_the_whole_set_warm(disk_tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = _cached(disk_tmp_path / "a.bin"), _cached(disk_tmp_path / "b.bin")
    real, calls = os.posix_fadvise, []

    def only_first(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            real(fd, offset, length, advice)

    monkeypatch.setattr(disks.os, "posix_fadvise", only_first)
    label = disks.evict_page_cache([first, second])
    assert len(calls) == 2
    assert disks.resident_fraction(first) < 0.02 and disks.resident_fraction(second) > 0.9
    assert label.startswith("warm (eviction failed: ") and label.endswith("% still cached)")
    assert int(label.split(": ")[1].split("%")[0]) >= 90  # the worst file, not the best


def test_file_on_tmpfs_is_never_called_cold() -> None:
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and _fstype(shm) in _RAM_FS):
        pytest.skip("no writable tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir=shm) as folder:
        path = _cached(Path(folder) / "in-ram.bin")
        label = disks.evict_page_cache([path])
        assert label.startswith("warm (eviction failed: "), label
        assert disks.resident_fraction(path) > 0.9
