"""Disks and the page cache: what kind of storage a path is on, and whether its pages are in RAM.

`disks()` lists the real mounted filesystems with their kind; `disk_kind(path)` answers for the
filesystem holding a path. `resident_fraction(path)` asks the kernel (mincore) how much of a file
is in the page cache; `evict_page_cache(paths)` drops files from it and says whether that worked,
so a measurement is never labelled "cold" when it was not.
"""

from __future__ import annotations

import os

_PSEUDO = {"proc", "sysfs", "devtmpfs", "devpts", "tmpfs", "cgroup", "cgroup2", "mqueue",
           "debugfs", "securityfs", "pstore", "bpf", "tracefs", "configfs", "fusectl", "ramfs",
           "hugetlbfs", "autofs", "binfmt_misc", "rpc_pipefs", "nsfs", "squashfs", "efivarfs",
           "selinuxfs", "nfsd"}
_NETWORK = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
            "glusterfs", "wekafs", "juicefs", "s3fs", "gcsfuse", "goofys", "mountpoint-s3",
            "rclone", "sshfs", "blobfuse2", "geesefs", "alluxio-fuse"}


def _mounts() -> list[tuple[str, str, str, str]]:
    """(device, mountpoint, fstype, options) from /proc/mounts; empty where there is none."""
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    unescape = lambda s: s.replace("\\040", " ").replace("\\011", "\t")  # noqa: E731
    return [(unescape(p[0]), unescape(p[1]), p[2], p[3]) for p in map(str.split, lines)
            if len(p) >= 4]


def _block_is_nvme(name: str, depth: int = 0) -> bool:
    """nvme by name, or an LVM / md device whose underlying devices are all nvme."""
    if name.startswith("nvme"):
        return True
    slaves = f"/sys/class/block/{name}/slaves"
    kids = os.listdir(slaves) if depth < 4 and os.path.isdir(slaves) else []
    return bool(kids) and all(_block_is_nvme(k, depth + 1) for k in kids)


def _kind(device: str, fstype: str, options: str, depth: int = 0) -> str:
    sub = fstype.split(".", 1)[1] if fstype.startswith("fuse.") else ""
    if fstype in _NETWORK or sub in _NETWORK or (fstype == "fuse" and device in _NETWORK):
        return "network"
    if fstype == "overlay" and depth == 0:
        upper = [o[9:] for o in options.split(",") if o.startswith("upperdir=")]
        return _path_kind(upper[0], 1) if upper else "other"
    if device.startswith("/dev/"):
        return "nvme" if _block_is_nvme(os.path.basename(os.path.realpath(device))) else "other"
    return "other"


def _media(device: str) -> str:
    """'rotational' / 'non-rotational' from sysfs (a partition asks its parent disk)."""
    sys_dir = os.path.realpath(f"/sys/class/block/{os.path.basename(os.path.realpath(device))}")
    if os.path.exists(os.path.join(sys_dir, "partition")):
        sys_dir = os.path.dirname(sys_dir)
    try:
        with open(os.path.join(sys_dir, "queue", "rotational")) as f:
            return "rotational" if f.read().strip() == "1" else "non-rotational"
    except OSError:
        return ""


def disks() -> list[dict[str, str]]:
    """Each real mounted filesystem: mountpoint, device, fstype, kind (nvme/network/other)."""
    out = []
    for device, mountpoint, fstype, options in _mounts():
        if fstype in _PSEUDO or mountpoint.startswith(("/proc", "/sys", "/dev/")):
            continue
        out.append({"mountpoint": mountpoint, "device": device, "fstype": fstype,
                    "kind": _kind(device, fstype, options),
                    "media": _media(device) if device.startswith("/dev/") else ""})
    return out


def disk_kind(path: str | os.PathLike[str]) -> str:
    """'nvme', 'network' or 'other' for the filesystem holding path (its longest mount prefix)."""
    return _path_kind(path, 0)


def _path_kind(path: str | os.PathLike[str], depth: int) -> str:
    real = os.path.realpath(path)
    hits = [(len(m[1]), i, m) for i, m in enumerate(_mounts())
            if m[1] == "/" or real == m[1] or real.startswith(m[1].rstrip("/") + "/")]
    if not hits:
        return "other"
    device, _, fstype, options = max(hits)[2]  # ties: the later mount hides the earlier one
    return _kind(device, fstype, options, depth)


# -- page cache ---------------------------------------------------------------------------------
def resident_fraction(path: str | os.PathLike[str]) -> float:
    """Share of a file's pages in the page cache (mincore on a read-only mapping); NaN if unknown."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return float("nan")
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        # mapping a file reads nothing; mincore then asks which of its pages are resident
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        try:
            if libc.mincore(addr, size, vec) != 0:
                return float("nan")
        finally:
            libc.munmap(addr, size)
    return sum(v & 1 for v in vec) / pages


def evict_page_cache(paths: list[str | os.PathLike[str]]) -> str:
    """Drop these files from the page cache so the next read comes from the disk.

    Uses posix_fadvise(DONTNEED) per file, which needs no root and leaves the rest of the
    machine's cache alone; returns the `cache_state` label to report: "cold" when every file
    was verified non-resident afterwards, else "warm (eviction failed: ...)" so a figure is
    never called cold when it is not.
    """
    files = [os.fspath(p) for p in paths]
    for path in files:
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # dirty pages cannot be dropped until they are written
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    left = [resident_fraction(p) for p in files]
    known = [x for x in left if x == x]  # NaN: mincore unavailable
    if not known:
        return "cold (posix_fadvise DONTNEED, unverified)"
    worst = max(known)
    return "cold" if worst <= 0.02 else f"warm (eviction failed: {worst:.0%} still cached)"
