"""What machine this is: accelerator, dense peak FLOP/s (gpus.py's table, or a CPU matmul probe),
CPU, RAM, disks (`run_info`: `diag info`). `sync()` is the one place diag waits for a device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from diag.machine.disks import disks
from diag.machine.gpus import _dtype, dense_peak_flops, find_gpu  # noqa: F401  (re-exported)
from diag.runner import quietly

if TYPE_CHECKING:
    import pandas as pd
    import torch

CPU_THREADS_ENV = "DIAG_CPU_THREADS"  # torch intra-op threads of diag's steps on a CPU
CPU_THREADS_DEFAULT = 1
PROBE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
Run = TypeVar("Run", bound=Callable[..., Any])


@dataclass(frozen=True)
class Peak:
    """A peak FLOP/s figure and where it came from; flops None: not known."""

    flops: float | None
    label: str
    source: str
    measured: bool
    dtype: str = "bf16"
    spread: float = 0.0  # a probe's samples' IQR over median (0: a table figure)


def usable_cores() -> int:
    """Cores this process may run on (its affinity: taskset, cpuset, Slurm), not the machine's."""
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1


def cpu_thread_count() -> int:
    """DIAG_CPU_THREADS, else 1: the intra-op threads diag's timed steps use on a CPU."""
    raw = os.environ.get(CPU_THREADS_ENV, "").strip() or str(CPU_THREADS_DEFAULT)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{CPU_THREADS_ENV}={raw!r}: must be a whole number >= 1")
    return int(raw)


@contextlib.contextmanager
def cpu_threads(device: Any = "auto") -> Iterator[None]:
    """On a CPU, run the block with cpu_thread_count() torch threads (docs/calibration.md)."""
    import torch

    before = torch.get_num_threads()
    if resolve(device).type == "cpu":
        torch.set_num_threads(cpu_thread_count())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def on_cpu_threads(run: Run) -> Run:
    """run(cfg, ...) under cpu_threads(cfg.device), quietly: every experiment's entry point."""

    @functools.wraps(run)
    def wrapper(cfg: Any = None, *args: Any, **kwargs: Any) -> Any:
        with cpu_threads(getattr(cfg, "device", "auto")):
            return run(cfg, *args, **kwargs)

    return quietly(wrapper)  # type: ignore[return-value]


def cpu_matmul_probe(size: int = 1024, repeats: int = 9, dtype: str = "fp32") -> list[float]:
    """Matmul FLOP per CPU second in dtype (a neighbour does not lower it), one per repeat."""
    import torch

    if size <= 0 or repeats <= 0:
        raise ValueError(f"size={size}, repeats={repeats}: both must be > 0")
    kind = getattr(torch, PROBE_DTYPES[_dtype(dtype)])
    a, b = torch.randn(size, size, dtype=kind), torch.randn(size, size, dtype=kind)
    samples = []
    for _ in range(repeats + 2):  # the first two: thread pool, allocator, BLAS kernel choice
        t0 = time.process_time()
        torch.mm(a, b)
        samples.append(2 * size**3 / max(time.process_time() - t0, 1e-9))
    return samples[2:]


def resolve(device: Any = "auto") -> torch.device:
    """'auto' -> cuda if visible else cpu; 'cuda' without a GPU raises RuntimeError."""
    import torch

    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: allowed values are 'auto', 'cpu', 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r}: no CUDA device is visible on this machine; "
                           "use device='cpu' or device='auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise RuntimeError(f"device={device!r}: only {torch.cuda.device_count()} CUDA "
                           "device(s) are visible")
    return dev


def is_async(device: Any) -> bool:
    """Do kernels run asynchronously to Python (CUDA), so timings need a sync?"""
    import torch

    return torch.device(device).type == "cuda"


def sync(device: Any = None) -> None:
    """Wait for queued CUDA work; a no-op on CPU."""
    import torch

    if device is None:
        # CUDA never initialised: nothing was queued; skip the costly init
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # sync point: the current device's queue drains first
    elif is_async(device):
        torch.cuda.synchronize(device)  # sync point: a timer must not stop before the kernels


def peak_flops(device: Any = None, dtype: str = "bf16", *, probe_size: int = 1024,
               repeats: int = 9) -> Peak:
    """The peak MFU divides by: the table on CUDA; on CPU the best of `repeats` probes of dtype."""
    import torch

    key = _dtype(dtype)
    dev = resolve("auto" if device is None else device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        spec = find_gpu(name)
        if spec is None:
            return Peak(None, f"unknown GPU {name!r}: diag has no dense {key} peak for it; pass "
                        "the peak FLOP/s explicitly (e.g. from its datasheet, dense not sparse)",
                        "", False)
        if key not in spec.peaks:
            return Peak(None, f"{spec.name} has no {key} tensor-core figure (try "
                        + ", ".join(sorted(spec.peaks)) + ")", spec.source, False)
        return Peak(spec.peaks[key], f"table: {spec.name} dense {key}", spec.source, False)
    if key not in PROBE_DTYPES:
        return Peak(None, f"no CPU probe for {key}: one of " + ", ".join(PROBE_DTYPES), "",
                    False, key)
    from diag.noise import spread

    samples = cpu_matmul_probe(probe_size, repeats, key)
    label = (f"measured: CPU {key} matmul probe ({probe_size}x{probe_size}, "
             f"{torch.get_num_threads()} threads, best of {repeats} per CPU second, spread "
             f"{spread(samples):.0%})")
    # a CPU without native 16-bit matmuls widens them: its fastest multiply is the ceiling
    wide = cpu_matmul_probe(probe_size, repeats, "fp32") if key != "fp32" else []
    if max(wide, default=0) > max(samples):
        label += (f"; its fp32 probe is faster ({max(wide) / 1e12:.3g} TFLOP/s, spread "
                  f"{spread(wide):.0%}): a {key} matmul's ceiling on this CPU")
        samples = wide
    return Peak(max(samples), label, "cpu_matmul_probe", True, key, spread(samples))


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def driver_version() -> str | None:
    with contextlib.suppress(OSError), open("/proc/driver/nvidia/version") as f:
        return next((w for w in f.readline().split() if w[:1].isdigit() and "." in w), None)
    return None


def facts(probe: bool = True, probe_size: int = 1024) -> dict[str, Any]:
    """What this machine is; `peak` a Peak (on CPU measured only when probe)."""
    import psutil
    import torch

    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    if cuda or probe:  # on CPU fp32: the precision of diag's own CPU steps
        peak = peak_flops(None, "bf16" if cuda else "fp32", probe_size=probe_size)
    else:
        peak = Peak(None, "not measured: CPU probe disabled (probe=False)", "", False, "fp32")
    return {
        "accelerator": torch.cuda.get_device_name(0) if cuda else "none",
        "accelerator_count": torch.cuda.device_count() if cuda else 0,
        "accelerator_memory_gb": round(props.total_memory / 1e9, 1) if props else None,
        "cuda_version": torch.version.cuda if cuda else None,
        "driver_version": driver_version() if cuda else None,
        "torch_version": torch.__version__,
        "cpu_model": _cpu_model(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "cpu_cores_logical": psutil.cpu_count(logical=True),
        "ram_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "peak": peak,
        "disks": disks(),
    }


@on_cpu_threads
def run_info(cfg: Any) -> pd.DataFrame:  # an InfoConfig
    """`diag info`: one row per fact (fact, value, detail)."""
    import pandas as pd
    import torch

    f = facts(probe=cfg.probe, probe_size=cfg.probe_size)
    peak: Peak = f.pop("peak")
    rows = [(k, v, "") for k, v in f.items() if k != "disks"]
    rows.append((f"peak_tflops_{peak.dtype}", None if peak.flops is None else
                 round(peak.flops / 1e12, 3), peak.label + (
                     f"; source: {peak.source}" if peak.source and not peak.measured else "")))
    if resolve("auto").type == "cpu":
        rows.append(("cpu_threads", torch.get_num_threads(), "torch intra-op threads of diag's "
                     f"CPU steps ({CPU_THREADS_ENV}, default {CPU_THREADS_DEFAULT}: tiny ops on a "
                     "shared pool wait at its barriers)"))
    rows += [(f"disk:{d.mountpoint}", d.kind, f"{d.fstype} on {d.device}: {d.evidence}")
             for d in f["disks"]]
    return pd.DataFrame(rows, columns=["fact", "value", "detail"])
