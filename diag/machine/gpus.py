"""Dense peak FLOP/s of common training GPUs per dtype, each with its source (2:4-sparse figures
halved). `find_gpu(name)` matches `torch.cuda.get_device_name()`: longest pattern, else None.
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
