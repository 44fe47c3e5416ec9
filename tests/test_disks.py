"""diag.disks: the kind of the filesystem under a path, and the page cache (mincore, eviction)."""

from __future__ import annotations

import os

from diag import disks


def test_disk_kind(tmp_path: os.PathLike[str]) -> None:
    assert disks.disk_kind(tmp_path) in ("nvme", "network", "other")
    assert disks.disk_kind("/") in ("nvme", "network", "other")
    assert disks._kind("/dev/nvme0n1p1", "ext4", "rw") == "nvme"
    assert disks._kind("server:/export", "nfs4", "rw") == "network"
    assert disks._kind("bucket", "fuse.gcsfuse", "rw") == "network"
    assert disks._kind("mountpoint-s3", "fuse", "rw") == "network"
    assert disks._kind("overlay", "overlay", "rw,upperdir=/proc/x") == "other"


def test_disks_skip_pseudo_filesystems() -> None:
    kinds = disks.disks()
    assert all(d["fstype"] not in ("proc", "sysfs", "tmpfs", "cgroup") for d in kinds)
    assert all(d["kind"] in ("nvme", "network", "other") for d in kinds)


def test_evict_page_cache_makes_a_file_cold_and_says_so(tmp_path) -> None:
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
