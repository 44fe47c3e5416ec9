"""What machine this is: accelerator, its dense peak FLOP/s, CPU, RAM and the kind of each disk.

Peaks come from a table of vendor figures, always dense (2:4-sparse datasheet figures halved);
an unknown GPU gets no peak rather than a guess. On CPU the peak is a measured fp32 matmul probe,
labelled as measured. `run_info(cfg)` returns one row per fact (`fact`, `value`, `detail`).
`sync()` is the one place diag waits for an async device.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# The table lives in diag.gpus; these names are part of what this module answers.
from diag.gpus import DTYPES, GPUS, GpuSpec, _dtype, dense_peak_flops, find_gpu  # noqa: F401

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from diag.config import InfoConfig


@dataclass(frozen=True)
class Peak:
    """A peak FLOP/s figure and where it came from; flops is None when diag does not know it."""

    flops: float | None
    label: str
    source: str
    measured: bool


def cpu_matmul_probe(size: int = 1024, repeats: int = 5) -> float:
    """Measured fp32 matmul FLOP/s on CPU: warm up, then the median of `repeats` timings."""
    import torch

    if size <= 0 or repeats <= 0:
        raise ValueError(f"size={size}, repeats={repeats}: both must be > 0")
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(2):  # warm-up: thread pool start, allocator, BLAS kernel choice
        torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times)


def resolve(device: Any = "auto") -> torch.device:
    """'auto' -> cuda if visible else cpu; 'cuda' without a GPU raises RuntimeError."""
    import torch

    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r}: allowed values are 'auto', 'cpu', 'cuda'") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r}: no CUDA device is visible on this machine; "
                               "use device='cpu' or device='auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"device={device!r}: only {torch.cuda.device_count()} CUDA "
                               "device(s) are visible")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r}: allowed values are 'auto', 'cpu', 'cuda'")
    return dev


def is_async(device: Any) -> bool:
    """True where kernels run asynchronously to Python (CUDA), so timings need a sync."""
    import torch

    return torch.device(device).type == "cuda"


def sync(device: Any = None) -> None:
    """Wait for queued CUDA work; a no-op on CPU, where every op has finished when it returns."""
    import torch

    if device is None:
        # CUDA never initialised means nothing was ever queued: skip the (costly) init
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # sync point: a timer boundary on the current device; its queue must drain first
            torch.cuda.synchronize()
        return
    if is_async(device):
        # sync point: kernels are queued, not done; a timer must not stop before they finish
        torch.cuda.synchronize(device)


def peak_flops(device: Any = None, dtype: str = "bf16", *, probe_size: int = 1024) -> Peak:
    """The peak to compute MFU against: table lookup on CUDA, a measured probe on CPU."""
    import torch

    key = _dtype(dtype)
    dev = resolve("auto" if device is None else device)
    if dev.type == "cpu":
        flops = cpu_matmul_probe(probe_size)
        label = (f"measured: CPU fp32 matmul probe ({probe_size}x{probe_size}, "
                 f"{torch.get_num_threads()} threads)")
        return Peak(flops, label, "cpu_matmul_probe", measured=True)
    name = torch.cuda.get_device_name(dev)
    spec = find_gpu(name)
    if spec is None:
        return Peak(None, f"unknown GPU {name!r}: diag has no dense {key} peak for it; pass the "
                    "peak FLOP/s explicitly (e.g. from its datasheet, dense not sparse)", "", False)
    if key not in spec.peaks:
        return Peak(None, f"{spec.name} has no {key} tensor-core figure (try "
                    + ", ".join(sorted(spec.peaks)) + ")", spec.source, False)
    return Peak(spec.peaks[key], f"table: {spec.name} dense {key}", spec.source, False)


# -- machine facts ------------------------------------------------------------------------------
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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


def facts(probe: bool = True, probe_size: int = 1024) -> dict[str, Any]:
    """What this machine is; `peak` is a Peak (measured on CPU only when probe is True)."""
    import psutil
    import torch

    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    if cuda or probe:
        peak = peak_flops(None, "bf16", probe_size=probe_size)
    else:
        peak = Peak(None, "not measured: CPU probe disabled (probe=False)", "", False)
    return {
        "accelerator": torch.cuda.get_device_name(0) if cuda else "none",
        "accelerator_count": torch.cuda.device_count() if cuda else 0,
        "accelerator_memory_gb": round(props.total_memory / 1e9, 1) if props else None,
        "cuda_version": torch.version.cuda if cuda else None,
        "driver_version": _driver_version() if cuda else None,
        "torch_version": torch.__version__,
        "cpu_model": _cpu_model(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "cpu_cores_logical": psutil.cpu_count(logical=True),
        "ram_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "peak": peak,
        "disks": disks(),
    }


def run_info(cfg: InfoConfig) -> pd.DataFrame:
    """`diag info` as a tidy frame: one row per fact (`fact`, `value`, `detail`)."""
    import pandas as pd

    f = facts(probe=cfg.probe, probe_size=cfg.probe_size)
    peak: Peak = f.pop("peak")
    rows = [{"fact": k, "value": v, "detail": ""} for k, v in f.items() if k != "disks"]
    source = f"; source: {peak.source}" if peak.source and not peak.measured else ""
    tflops = None if peak.flops is None else round(peak.flops / 1e12, 3)
    rows.append({"fact": "peak_tflops_bf16", "value": tflops, "detail": peak.label + source})
    for d in f["disks"]:
        detail = f"{d['fstype']} on {d['device']}" + (f" ({d['media']})" if d["media"] else "")
        rows.append({"fact": f"disk:{d['mountpoint']}", "value": d["kind"], "detail": detail})
    return pd.DataFrame(rows, columns=["fact", "value", "detail"])


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
