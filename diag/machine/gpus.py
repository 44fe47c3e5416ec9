"""Dense peak FLOP/s of common training GPUs, per dtype, each entry with its source.

Datasheets' 2:4-sparse figures are halved, so an MFU is never flattered. `find_gpu(name)` matches
`torch.cuda.get_device_name()` (longest pattern wins; unknown: None, never a guess).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
            "float": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: dense peaks per dtype in FLOP/s ("fp32": the non-tensor CUDA-core rate)."""

    name: str
    patterns: tuple[str, ...]  # token sequences matched against the device name
    memory_gb: float
    peaks: dict[str, float] = field(hash=False)
    source: str


def _g(name: str, patterns: tuple[str, ...], mem: float, source: str, *, fp32: float,
       bf16: float | None = None, tf32: float | None = None, fp16: float | None = None,
       fp8: float | None = None) -> GpuSpec:
    """An entry from TFLOP/s; fp16 defaults to bf16 (the same tensor-core rate on every card)."""
    tf = {"bf16": bf16, "fp16": fp16 or bf16, "tf32": tf32, "fp32": fp32, "fp8": fp8}
    return GpuSpec(name, patterns, mem, {k: v * 1e12 for k, v in tf.items() if v}, source)


_HALF = "datasheet; sparse figures halved"
_H100 = f"NVIDIA H100 Tensor Core GPU {_HALF}"
_A100 = f"NVIDIA A100 Tensor Core GPU {_HALF}"
_ADA_WP = "NVIDIA Ada Lovelace whitepaper, Appendix A, FP32 accumulate, dense"
# GeForce RTX 40 spec pages give 'AI TOPS' = FP8 sparse with FP16 accumulate = 8x dense BF16
# with FP32 accumulate (checks out against the whitepaper for the 4090 and 4080).
_ADA_PAGE = "NVIDIA GeForce RTX 40 spec page, AI TOPS / 8 (dense, FP32 accumulate)"
_GA102 = "NVIDIA Ampere GA102 whitepaper, Appendix A, dense"
GPUS: tuple[GpuSpec, ...] = (
    _g("B200", ("b200",), 180, f"NVIDIA HGX B200 {_HALF} (per-GPU column)",
       bf16=2250, tf32=1100, fp32=75, fp8=4500),
    # Hopper. H200 SXM computes like the H100 SXM; NVL cards run at lower clocks.
    _g("H200 SXM", ("h200",), 141, f"NVIDIA H200 {_HALF}", bf16=989.4, tf32=494.7, fp32=67,
       fp8=1978.9),
    _g("H200 NVL", ("h200 nvl",), 141, f"NVIDIA H200 {_HALF} (NVL column)", bf16=835.5,
       tf32=417.5, fp32=60, fp8=1670.5),
    _g("H100 SXM", ("h100 80gb hbm3", "h100 sxm", "h100 sxm5"), 80, _H100, bf16=989.4,
       tf32=494.7, fp32=67, fp8=1978.9),
    _g("H100 PCIe", ("h100 pcie",), 80, _H100, bf16=756.5, tf32=378, fp32=51, fp8=1513),
    _g("H100 NVL", ("h100 nvl",), 94, _H100 + " (NVL column, per GPU)", bf16=835.5, tf32=417.5,
       fp32=60, fp8=1670.5),
    # Ampere data centre; the PCIe A100 has the SXM peak (it sustains lower clocks at 300 W).
    _g("A100 40GB", ("a100 sxm4 40gb", "a100 pcie 40gb", "a100 40gb"), 40, _A100, bf16=312,
       tf32=156, fp32=19.5),
    _g("A100 80GB", ("a100 sxm4 80gb", "a100 80gb pcie", "a100 sxm 80gb", "a100 80gb"), 80, _A100,
       bf16=312, tf32=156, fp32=19.5),
    _g("A40", ("a40",), 48, f"NVIDIA A40 {_HALF}", bf16=149.7, tf32=74.8, fp32=37.4),
    _g("A30", ("a30",), 24, f"NVIDIA A30 {_HALF}", bf16=165, tf32=82, fp32=10.3),
    _g("A10", ("a10",), 24, f"NVIDIA A10 {_HALF}", bf16=125, tf32=62.5, fp32=31.2),
    # A10G (AWS only): no NVIDIA datasheet; half the A10's tensor rate, more FP32.
    _g("A10G", ("a10g",), 24, "AWS EC2 G5 / Baseten 'A10 vs A10G' spec table, dense", bf16=70,
       tf32=35, fp32=35),
    # Workstation cards run FP32-accumulate tensor math at full rate (GeForce at half).
    _g("RTX A6000", ("rtx a6000",), 48, _GA102, bf16=154.8, tf32=77.4, fp32=38.7),
    _g("RTX 6000 Ada", ("rtx 6000 ada",), 48, _ADA_WP, bf16=364.2, tf32=182.1, fp32=91.1,
       fp8=728.5),
    _g("L40S", ("l40s",), 48, f"NVIDIA L40S {_HALF}", bf16=362.05, tf32=183, fp32=91.6, fp8=733),
    _g("L40", ("l40",), 48, f"NVIDIA L40 {_HALF}", bf16=181.05, tf32=90.5, fp32=90.5, fp8=362),
    _g("L4", ("l4",), 24, f"NVIDIA L4 {_HALF}", bf16=121, tf32=60, fp32=30.3, fp8=242.5),
    # GeForce: the FP32-accumulate rate PyTorch uses, half the FP16-accumulate headline.
    _g("RTX 4090", ("rtx 4090",), 24, _ADA_WP, bf16=165.2, tf32=82.6, fp32=82.6, fp8=330.3),
    _g("RTX 4080 SUPER", ("rtx 4080 super",), 16, _ADA_PAGE, bf16=104.5, tf32=52.2, fp32=52.2,
       fp8=209),
    _g("RTX 4080", ("rtx 4080",), 16, _ADA_WP, bf16=97.5, tf32=48.7, fp32=48.7, fp8=194.9),
    _g("RTX 4070 Ti SUPER", ("rtx 4070 ti super",), 16, _ADA_PAGE, bf16=88.2, tf32=44.1,
       fp32=44.1, fp8=176.5),
    _g("RTX 4070 Ti", ("rtx 4070 ti",), 12, _ADA_PAGE, bf16=80.1, tf32=40.1, fp32=40.1,
       fp8=160.3),
    _g("RTX 4070 SUPER", ("rtx 4070 super",), 12, _ADA_PAGE, bf16=71.0, tf32=35.5, fp32=35.5,
       fp8=142),
    _g("RTX 4070", ("rtx 4070",), 12, _ADA_PAGE, bf16=58.3, tf32=29.1, fp32=29.1, fp8=116.6),
    _g("RTX 3090", ("rtx 3090",), 24, _GA102.replace("dense", "FP32 accumulate, dense"), bf16=71,
       tf32=35.6, fp32=35.6),
    # Turing / Volta: no bf16, tf32 or sparsity; fp16 is the tensor figure.
    _g("T4", ("t4",), 16, "NVIDIA T4 datasheet (FP16 mixed precision)", fp16=65, fp32=8.1),
    _g("V100 SXM2 16GB", ("v100 sxm2 16gb", "v100 sxm2"), 16, "NVIDIA V100 datasheet, SXM2",
       fp16=125, fp32=15.7),
    _g("V100 SXM2 32GB", ("v100 sxm2 32gb", "v100 sxm3 32gb"), 32, "NVIDIA V100 datasheet, SXM2",
       fp16=125, fp32=15.7),
    _g("V100 PCIe", ("v100 pcie",), 16, "NVIDIA V100 datasheet, PCIe", fp16=112, fp32=14),
    _g("V100S PCIe", ("v100s",), 32, "NVIDIA V100S datasheet", fp16=130, fp32=16.4),
)


def _tokens(text: str) -> tuple[str, ...]:
    return tuple(text.lower().replace("-", " ").replace("_", " ").replace("/", " ").split())


def find_gpu(name: str) -> GpuSpec | None:
    """The table entry for a device name (longest matching pattern), or None."""
    words = _tokens(name)
    best: tuple[int, GpuSpec] | None = None
    for spec in GPUS:
        for pattern in spec.patterns:
            p = _tokens(pattern)
            hit = any(words[i:i + len(p)] == p for i in range(len(words) - len(p) + 1))
            if hit and (best is None or len(p) > best[0]):
                best = (len(p), spec)
    return best[1] if best else None


def _dtype(dtype: Any) -> str:
    key = str(dtype).removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed values are " + ", ".join(DTYPES))
    return key


def dense_peak_flops(name: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of the named GPU for dtype; None for an unknown GPU or missing dtype."""
    key = _dtype(dtype)
    spec = find_gpu(name)
    return None if spec is None else spec.peaks.get(key)
