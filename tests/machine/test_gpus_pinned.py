"""Every GPUS entry of diag.machine.device pinned, dtype by dtype, to its datasheet's dense figure
(sparse figures halved, as the table's sources say): a value from the wrong column fails here."""

from __future__ import annotations

import pytest

from diag.machine.device import DTYPES, GPUS

# name: dense TFLOP/s per dtype in diag.machine.device.DTYPES order (bf16, fp16, tf32, fp32,
# fp8); None: the card has no tensor path for that dtype (MFU against it is left empty, never
# guessed)
PINNED = {
    "B200": (2250.0, 2250.0, 1100.0, 75.0, 4500.0),
    "H200 SXM": (989.4, 989.4, 494.7, 67.0, 1978.9),
    "H200 NVL": (835.5, 835.5, 417.5, 60.0, 1670.5),
    "H100 SXM": (989.4, 989.4, 494.7, 67.0, 1978.9),
    "H100 PCIe": (756.5, 756.5, 378.0, 51.0, 1513.0),
    "H100 NVL": (835.5, 835.5, 417.5, 60.0, 1670.5),
    "A100 40GB": (312.0, 312.0, 156.0, 19.5, None),
    "A100 80GB": (312.0, 312.0, 156.0, 19.5, None),
    "A40": (149.7, 149.7, 74.8, 37.4, None),
    "A30": (165.0, 165.0, 82.0, 10.3, None),
    "A10": (125.0, 125.0, 62.5, 31.2, None),
    "A10G": (70.0, 70.0, 35.0, 35.0, None),
    "RTX A6000": (154.8, 154.8, 77.4, 38.7, None),
    "RTX 6000 Ada": (364.2, 364.2, 182.1, 91.1, 728.5),
    "L40S": (362.05, 362.05, 183.0, 91.6, 733.0),
    "L40": (181.05, 181.05, 90.5, 90.5, 362.0),
    "L4": (121.0, 121.0, 60.0, 30.3, 242.5),
    "RTX 4090": (165.2, 165.2, 82.6, 82.6, 330.3),
    "RTX 4080 SUPER": (104.5, 104.5, 52.2, 52.2, 209.0),
    "RTX 4080": (97.5, 97.5, 48.7, 48.7, 194.9),
    "RTX 4070 Ti SUPER": (88.2, 88.2, 44.1, 44.1, 176.5),
    "RTX 4070 Ti": (80.1, 80.1, 40.1, 40.1, 160.3),
    "RTX 4070 SUPER": (71.0, 71.0, 35.5, 35.5, 142.0),
    "RTX 4070": (58.3, 58.3, 29.1, 29.1, 116.6),
    "RTX 3090": (71.0, 71.0, 35.6, 35.6, None),
    "T4": (None, 65.0, None, 8.1, None),
    "V100 SXM2 16GB": (None, 125.0, None, 15.7, None),
    "V100 SXM2 32GB": (None, 125.0, None, 15.7, None),
    "V100 PCIe": (None, 112.0, None, 14.0, None),
    "V100S PCIe": (None, 130.0, None, 16.4, None),
}


def test_every_entry_is_pinned() -> None:
    assert DTYPES == ("bf16", "fp16", "tf32", "fp32", "fp8")
    assert sorted(PINNED) == sorted(g.name for g in GPUS)


@pytest.mark.parametrize("spec", GPUS, ids=lambda g: g.name)
def test_entry_matches_its_dense_datasheet_figures(spec) -> None:
    for dtype, tflops in zip(DTYPES, PINNED[spec.name], strict=True):
        got = spec.peaks.get(dtype)
        if tflops is None:
            assert got is None, f"{spec.name} {dtype}: {got}"
        else:
            assert got == pytest.approx(tflops * 1e12, rel=1e-6), f"{spec.name} {dtype}"
