"""Disks and the page cache: `disk_kind(path)` names the storage a path is on (cloud volumes by
their sysfs model: an EBS volume is `nvme*` too); `resident_fraction(path)` asks mincore;
`evict_page_cache(paths)` says if it worked.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# fastest to reuse first
KINDS = ("local_nvme", "local_ssd", "local_hdd", "network_block", "network_file", "virtual",
         "other")
_PSEUDO = set("proc sysfs devtmpfs devpts tmpfs cgroup cgroup2 mqueue debugfs securityfs pstore "
              "bpf tracefs configfs fusectl ramfs hugetlbfs autofs binfmt_misc rpc_pipefs nsfs "
              "squashfs efivarfs selinuxfs nfsd".split())
_NETWORK_FS = set("nfs nfs4 cifs smb3 smbfs lustre gpfs beegfs ceph glusterfs wekafs juicefs "
                  "s3fs gcsfuse goofys mountpoint-s3 rclone sshfs blobfuse2 geesefs "
                  "alluxio-fuse".split())
_HOST_SHARE_FS = {"virtiofs", "9p"}  # a folder shared by the hypervisor: backing unknown
# /sys/block/<dev>/device/model strings, first match wins ("nvme_card-pd" before "nvme_card<N>")
_MODELS = (
    (r"Amazon Elastic Block Store", "network_block", "AWS EBS volume"),
    (r"Amazon EC2 NVMe Instance Storage", "local_nvme", "AWS instance store"),
    (r"PersistentDisk", "network_block", "GCP Persistent Disk (SCSI)"),
    (r"nvme_card-pd", "network_block", "GCP Persistent Disk / Hyperdisk (NVMe)"),
    (r"nvme_card\d*$", "local_nvme", "GCP Local SSD (NVMe)"),
    (r"EphemeralDisk", "local_ssd", "GCP Local SSD (SCSI interface)"),
    (r"MSFT NVMe Accelerator", "network_block", "Azure managed disk (NVMe)"),
    (r"Microsoft NVMe Direct Disk", "local_nvme", "Azure local NVMe"),
    (r"QEMU|Virtual Disk|VMware Virtual|VBOX", "virtual", "emulated disk"),
)
_VIRTUAL_DRIVERS = {"virtio_blk": "virtio block device", "vbd": "Xen virtual block device",
                    "xen_blkfront": "Xen virtual block device"}
_NETWORK_BLOCK_NAMES = {"nbd": "network block device (nbd)", "rbd": "Ceph RBD"}


@dataclass(frozen=True)
class Disk:
    """One mounted filesystem, its kind (KINDS) and what that rests on."""

    mountpoint: str
    device: str
    fstype: str
    kind: str
    evidence: str


def is_network(kind: str) -> bool:
    """Storage reached over the network (EBS, PD, NFS, EFS, Lustre, FUSE object stores)?"""
    return kind.startswith("network")


def _mounts(mounts: str | None = None) -> list[tuple[str, str, str, str]]:
    """(device, mountpoint, fstype, options): psutil's, or a file in /proc/mounts format."""
    mounts = mounts or os.environ.get("DIAG_MOUNTS")  # another machine's layout (tests, a bug)
    if mounts is None:
        import psutil

        return [(p.device, p.mountpoint, p.fstype, p.opts)
                for p in psutil.disk_partitions(all=True)]
    unescape = lambda s: s.replace("\\040", " ").replace("\\011", "\t")  # noqa: E731
    return [(unescape(p[0]), unescape(p[1]), p[2], p[3])
            for p in map(str.split, _read(mounts).splitlines()) if len(p) >= 4]


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _root_device(mountpoint: str, sysfs: str) -> str:
    """/dev/root's real name: the block device whose major:minor is the mount's st_dev."""
    try:
        dev = os.stat(mountpoint).st_dev
    except OSError:
        return ""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    base = os.path.join(sysfs, "class", "block")
    names = sorted(os.listdir(base)) if os.path.isdir(base) else []
    return next((n for n in names if _read(os.path.join(base, n, "dev")) == want), "")


def _block(name: str, sysfs: str, depth: int = 0) -> tuple[str, str]:
    """(kind, evidence) of a block device: model string, then driver, then its members."""
    node = os.path.join(sysfs, "class", "block", name)
    if os.path.exists(os.path.join(node, "partition")):  # a partition: ask its disk
        disk = os.path.basename(os.path.dirname(os.path.realpath(node)))
        kind, evidence = _block(disk, sysfs, depth)
        return kind, f"{name} is a partition of {evidence}"
    slaves = os.path.join(node, "slaves")
    members = sorted(os.listdir(slaves)) if depth < 4 and os.path.isdir(slaves) else []
    if members:  # LVM / dm-crypt / md RAID: the kind of what it is built on
        parts = [_block(m, sysfs, depth + 1) for m in members]
        kinds = {k for k, _ in parts}
        kind = kinds.pop() if len(kinds) == 1 else "other"
        return kind, f"{name} over " + "; ".join(e for _, e in parts)
    model = _read(os.path.join(node, "device", "model"))
    for pattern, kind, what in _MODELS:
        if model and re.match(pattern, model):
            return kind, f"{name}: {what} (model {model!r})"
    driver = os.path.basename(os.path.realpath(os.path.join(node, "device", "driver")))
    if driver in _VIRTUAL_DRIVERS or name.startswith(("vd", "xvd")):
        what = _VIRTUAL_DRIVERS.get(driver, "virtual block device")
        return "virtual", f"{name}: {what}, its backing storage is not visible from the guest"
    if name[:3] in _NETWORK_BLOCK_NAMES:
        return "network_block", f"{name}: {_NETWORK_BLOCK_NAMES[name[:3]]}"
    label = f" (model {model!r})" if model else ""
    if name.startswith("nvme"):
        return "local_nvme", f"{name}: NVMe device{label}, no cloud network-disk model"
    if name.startswith(("loop", "zram", "ram")):
        return "other", f"{name}: {name.rstrip('0123456789')} device (memory or file backed)"
    rotational = _read(os.path.join(node, "queue", "rotational"))
    if rotational in ("0", "1"):
        return ("local_ssd", "local_hdd")[int(rotational)], f"{name}{label}: queue/rotational=" \
            + rotational
    return "other", f"{name}{label}: not found in sysfs"


def _classify(device: str, mountpoint: str, fstype: str, options: str, sysfs: str,
              mounts: str | None, depth: int = 0) -> tuple[str, str]:
    sub = fstype.split(".", 1)[1] if fstype.startswith("fuse.") else ""
    if fstype in _NETWORK_FS or sub in _NETWORK_FS or (fstype == "fuse" and device in _NETWORK_FS):
        what = ("AWS EFS" if ".efs." in device else "Lustre (FSx for Lustre on AWS)"
                if fstype == "lustre" else "a FUSE mount" if fstype.startswith("fuse")
                else "a network filesystem")
        return "network_file", f"{fstype} mount of {device}: {what}"
    if fstype in ("tmpfs", "ramfs"):
        return "other", f"{fstype}: in RAM, gone at reboot"
    if fstype in _HOST_SHARE_FS:
        return "virtual", f"{fstype}: a folder shared by the hypervisor, backing unknown"
    if fstype == "overlay":
        upper = [o[9:] for o in options.split(",") if o.startswith("upperdir=")]
        if depth == 0 and upper and os.path.exists(upper[0]):
            kind, evidence = describe(upper[0], sysfs, mounts, 1)
            return kind, f"overlay, upper layer {upper[0]} on {evidence}"
        return "other", "overlay (a container's root): its upper layer is not visible here"
    if device in ("/dev/root", "rootfs"):
        real = _root_device(mountpoint, sysfs)
        if not real:
            return "other", f"{device}: no block device in sysfs matches {mountpoint}'s st_dev"
        kind, evidence = _block(real, sysfs)
        return kind, f"{device} is {real}; {evidence}"
    if device.startswith("/dev/"):
        return _block(os.path.basename(os.path.realpath(device)), sysfs)
    return "other", f"{fstype} on {device}"


def disks(sysfs: str | None = None, mounts: str | None = None) -> list[Disk]:
    """Each real mounted filesystem (no /proc, /sys, tmpfs...) with its kind and evidence."""
    root = sysfs or os.environ.get("DIAG_SYSFS") or "/sys"
    return [Disk(mountpoint, device, fstype,
                 *_classify(device, mountpoint, fstype, options, root, mounts))
            for device, mountpoint, fstype, options in _mounts(mounts)
            if fstype not in _PSEUDO and not mountpoint.startswith(("/proc", "/sys", "/dev/"))]


def describe(path: str | os.PathLike[str], sysfs: str | None = None, mounts: str | None = None,
             depth: int = 0) -> tuple[str, str]:
    """(kind, evidence) for the filesystem holding path (its longest mount prefix)."""
    sysfs = sysfs or os.environ.get("DIAG_SYSFS") or "/sys"
    real = os.path.realpath(path)
    hits = [(len(m[1]), i, m) for i, m in enumerate(_mounts(mounts))
            if m[1] == "/" or real == m[1] or real.startswith(m[1].rstrip("/") + "/")]
    if not hits:
        return "other", f"{real}: no mount holds it"
    device, mountpoint, fstype, options = max(hits)[2]  # ties: the later mount hides the earlier
    kind, evidence = _classify(device, mountpoint, fstype, options, sysfs, mounts, depth)
    return kind, f"{mountpoint}: {evidence}"


def disk_kind(path: str | os.PathLike[str], sysfs: str | None = None,
              mounts: str | None = None) -> str:
    """One of KINDS for the filesystem holding path; is_network(kind) for EBS/PD/NFS/FUSE."""
    return describe(path, sysfs, mounts)[0]


def resident_fraction(path: str | os.PathLike[str]) -> float:
    """Share of a file's pages in the page cache (mincore); NaN if unknown."""
    import ctypes
    import mmap

    import numpy as np

    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
    try:  # mapping reads nothing; mincore says which pages are resident
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
            start = np.frombuffer(m, np.uint8)
            failed = ctypes.CDLL(None).mincore(ctypes.c_void_p(start.ctypes.data),
                                               ctypes.c_size_t(size), vec.ctypes.data_as(
                                                   ctypes.c_void_p))
            del start  # the map closes once nothing points into it
    except (OSError, AttributeError):  # no mincore in this libc
        return float("nan")
    return float("nan") if failed else float((vec & 1).mean())


def evict_page_cache(paths: list[str | os.PathLike[str]]) -> str:
    """Drop files from the page cache (posix_fadvise, no root); says "cold" or "warm (...)"."""
    files = [os.fspath(p) for p in paths]
    for path in files:
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # dirty pages cannot be dropped
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    left = [resident_fraction(p) for p in files]
    known = [x for x in left if x == x]  # NaN: mincore unavailable
    if not known:
        return "cold (posix_fadvise DONTNEED, unverified)"
    worst = max(known)
    return "cold" if worst <= 0.02 else f"warm (eviction failed: {worst:.0%} still cached)"
