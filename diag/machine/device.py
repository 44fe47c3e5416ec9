"""What machine this is: accelerator, dense peak FLOP/s (GPUS: datasheet dense peaks per dtype, 2:4-
sparse figures halved; or a CPU matmul probe), CPU, RAM, disks (`run_info`: `diag info`).
`sync()` is the one place diag waits for a device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from diag.machine.disks import disks
from diag.runner import quietly

if TYPE_CHECKING:
    import pandas as pd
    import torch

CPU_THREADS_ENV = "DIAG_CPU_THREADS"  # torch intra-op threads of diag's steps on a CPU
CPU_THREADS_DEFAULT = 1
DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
            "float": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}
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


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: dense peaks per dtype in FLOP/s ("fp32": the non-tensor CUDA-core rate)."""

    name: str
    patterns: tuple[str, ...]  # token sequences matched against the device name
    memory_gb: float
    peaks: dict[str, float] = field(hash=False)
    source: str


def _g(name: str, patterns: tuple[str, ...], mem: float, source: str, bf16: float | None = None,
       tf32: float | None = None, fp32: float = 0.0, fp8: float | None = None, *,
       fp16: float | None = None) -> GpuSpec:
    """An entry from TFLOP/s; fp16 defaults to bf16 (the same tensor-core rate on every card)."""
    tf = {"bf16": bf16, "fp16": fp16 or bf16, "tf32": tf32, "fp32": fp32, "fp8": fp8}
    return GpuSpec(name, patterns, mem, {k: v * 1e12 for k, v in tf.items() if v}, source)


_HALF = "datasheet; sparse figures halved"
_H100, _H200 = f"NVIDIA H100 Tensor Core GPU {_HALF}", f"NVIDIA H200 {_HALF}"
_A100 = f"NVIDIA A100 Tensor Core GPU {_HALF}"
_ADA_WP = "NVIDIA Ada Lovelace whitepaper, Appendix A, FP32 accumulate, dense"
# GeForce RTX 40 spec pages give 'AI TOPS' = FP8 sparse with FP16 accumulate = 8x dense BF16
# with FP32 accumulate (checks out against the whitepaper for the 4090 and 4080).
_ADA_PAGE = "NVIDIA GeForce RTX 40 spec page, AI TOPS / 8 (dense, FP32 accumulate)"
_GA102 = "NVIDIA Ampere GA102 whitepaper, Appendix A, dense"
_V100 = "NVIDIA V100 datasheet, "
# name, device-name patterns, memory GB, source; dense TFLOP/s: bf16, tf32, fp32, fp8
GPUS: tuple[GpuSpec, ...] = (
    _g("B200", ("b200",), 180, f"NVIDIA HGX B200 {_HALF} (per-GPU column)", 2250, 1100, 75, 4500),
    # Hopper. H200 SXM computes like the H100 SXM; NVL cards run at lower clocks.
    _g("H200 SXM", ("h200",), 141, _H200, 989.4, 494.7, 67, 1978.9),
    _g("H200 NVL", ("h200 nvl",), 141, f"{_H200} (NVL column)", 835.5, 417.5, 60, 1670.5),
    _g("H100 SXM", ("h100 80gb hbm3", "h100 sxm", "h100 sxm5"), 80, _H100, 989.4, 494.7, 67,
       1978.9),
    _g("H100 PCIe", ("h100 pcie",), 80, _H100, 756.5, 378, 51, 1513),
    _g("H100 NVL", ("h100 nvl",), 94, f"{_H100} (NVL column, per GPU)", 835.5, 417.5, 60, 1670.5),
    # Ampere data centre; the PCIe A100 has the SXM peak (it sustains lower clocks at 300 W).
    _g("A100 40GB", ("a100 sxm4 40gb", "a100 pcie 40gb", "a100 40gb"), 40, _A100, 312, 156, 19.5),
    _g("A100 80GB", ("a100 sxm4 80gb", "a100 80gb pcie", "a100 sxm 80gb", "a100 80gb"), 80, _A100,
       312, 156, 19.5),
    _g("A40", ("a40",), 48, f"NVIDIA A40 {_HALF}", 149.7, 74.8, 37.4),
    _g("A30", ("a30",), 24, f"NVIDIA A30 {_HALF}", 165, 82, 10.3),
    _g("A10", ("a10",), 24, f"NVIDIA A10 {_HALF}", 125, 62.5, 31.2),
    # A10G (AWS only): no NVIDIA datasheet; half the A10's tensor rate, more FP32.
    _g("A10G", ("a10g",), 24, "AWS EC2 G5 / Baseten 'A10 vs A10G' spec table, dense", 70, 35, 35),
    # Workstation cards run FP32-accumulate tensor math at full rate (GeForce at half).
    _g("RTX A6000", ("rtx a6000",), 48, _GA102, 154.8, 77.4, 38.7),
    _g("RTX 6000 Ada", ("rtx 6000 ada",), 48, _ADA_WP, 364.2, 182.1, 91.1, 728.5),
    _g("L40S", ("l40s",), 48, f"NVIDIA L40S {_HALF}", 362.05, 183, 91.6, 733),
    _g("L40", ("l40",), 48, f"NVIDIA L40 {_HALF}", 181.05, 90.5, 90.5, 362),
    _g("L4", ("l4",), 24, f"NVIDIA L4 {_HALF}", 121, 60, 30.3, 242.5),
    # GeForce: the FP32-accumulate rate PyTorch uses, half the FP16-accumulate headline.
    _g("RTX 4090", ("rtx 4090",), 24, _ADA_WP, 165.2, 82.6, 82.6, 330.3),
    _g("RTX 4080 SUPER", ("rtx 4080 super",), 16, _ADA_PAGE, 104.5, 52.2, 52.2, 209),
    _g("RTX 4080", ("rtx 4080",), 16, _ADA_WP, 97.5, 48.7, 48.7, 194.9),
    _g("RTX 4070 Ti SUPER", ("rtx 4070 ti super",), 16, _ADA_PAGE, 88.2, 44.1, 44.1, 176.5),
    _g("RTX 4070 Ti", ("rtx 4070 ti",), 12, _ADA_PAGE, 80.1, 40.1, 40.1, 160.3),
    _g("RTX 4070 SUPER", ("rtx 4070 super",), 12, _ADA_PAGE, 71.0, 35.5, 35.5, 142),
    _g("RTX 4070", ("rtx 4070",), 12, _ADA_PAGE, 58.3, 29.1, 29.1, 116.6),
    _g("RTX 3090", ("rtx 3090",), 24, _GA102.replace("dense", "FP32 accumulate, dense"), 71, 35.6,
       35.6),
    # Turing / Volta: no bf16, tf32 or sparsity; fp16 is the tensor figure.
    _g("T4", ("t4",), 16, "NVIDIA T4 datasheet (FP16 mixed precision)", fp16=65, fp32=8.1),
    _g("V100 SXM2 16GB", ("v100 sxm2 16gb", "v100 sxm2"), 16, _V100 + "SXM2", fp16=125, fp32=15.7),
    _g("V100 SXM2 32GB", ("v100 sxm2 32gb", "v100 sxm3 32gb"), 32, _V100 + "SXM2", fp16=125,
       fp32=15.7),
    _g("V100 PCIe", ("v100 pcie",), 16, _V100 + "PCIe", fp16=112, fp32=14),
    _g("V100S PCIe", ("v100s",), 32, "NVIDIA V100S datasheet", fp16=130, fp32=16.4),
)


def _tokens(text: str) -> tuple[str, ...]:
    return tuple(text.lower().replace("-", " ").replace("_", " ").replace("/", " ").split())


def find_gpu(name: str) -> GpuSpec | None:
    """The table entry for a device name (longest matching pattern), or None."""
    words = _tokens(name)
    hits = [(len(p), spec) for spec in GPUS for p in map(_tokens, spec.patterns)
            if any(words[i:i + len(p)] == p for i in range(len(words) - len(p) + 1))]
    return max(hits, key=lambda hit: hit[0])[1] if hits else None


def _dtype(dtype: Any) -> str:
    key = str(dtype).removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed values are " + ", ".join(DTYPES))
    return key


def dense_peak_flops(name: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of the named GPU for dtype; None for an unknown GPU or missing dtype."""
    key, spec = _dtype(dtype), find_gpu(name)
    return None if spec is None else spec.peaks.get(key)


def usable_cores() -> int:
    """Cores this process may run on (its affinity: taskset, cpuset, Slurm), not the machine's."""
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1


@contextlib.contextmanager
def cpu_threads(device: Any = "auto") -> Iterator[None]:
    """On a CPU, run the block with DIAG_CPU_THREADS (default 1) torch threads (calibration.md)."""
    import torch

    before = torch.get_num_threads()
    if resolve(device).type == "cpu":
        raw = os.environ.get(CPU_THREADS_ENV, "").strip() or str(CPU_THREADS_DEFAULT)
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{CPU_THREADS_ENV}={raw!r}: must be a whole number >= 1")
        torch.set_num_threads(int(raw))
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
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.lower().startswith(
            ("model name", "hardware", "cpu model"))), "")
    return {
        "accelerator": torch.cuda.get_device_name(0) if cuda else "none",
        "accelerator_count": torch.cuda.device_count() if cuda else 0,
        "accelerator_memory_gb": round(props.total_memory / 1e9, 1) if props else None,
        "cuda_version": torch.version.cuda if cuda else None,
        "driver_version": driver_version() if cuda else None,
        "torch_version": torch.__version__,
        "cpu_model": model or platform.processor() or platform.machine() or "unknown",
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
