"""diag.machine.device: the dense peak table, name matching, the CPU probe, sync/resolve and machine
facts."""

from __future__ import annotations

import pytest
import torch

from diag.machine import device as dev
from diag.config import InfoConfig

T = 1e12


@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156),
        ("NVIDIA L4", "bf16", 121),  # datasheet headline 242 is 2:4 sparse
        ("NVIDIA L40S", "bf16", 362),  # datasheet headline 733 is 2:4 sparse
        ("NVIDIA A10", "bf16", 125),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),  # FP32 accumulate, not 330 (FP16 acc)
        ("NVIDIA GeForce RTX 3090", "bf16", 71),
        ("Tesla T4", "fp16", 65),
        ("Tesla V100-SXM2-16GB", "fp16", 125),
    ],
)
def test_known_dense_values(name: str, dtype: str, tflops: float) -> None:
    got = dev.dense_peak_flops(name, dtype)
    assert got == pytest.approx(tflops * T, rel=0.01)


def test_table_structure() -> None:
    assert len({s.name for s in dev.GPUS}) == len(dev.GPUS)
    for spec in dev.GPUS:
        assert spec.source.strip(), spec.name
        assert spec.memory_gb > 0, spec.name
        assert spec.peaks and set(spec.peaks) <= set(dev.DTYPES), spec.name
        p = spec.peaks
        assert all(v > 1e12 for v in p.values()), spec.name
        assert "fp16" in p and "fp32" in p, spec.name
        if "bf16" in p and "fp8" in p:
            assert p["bf16"] <= p["fp8"], spec.name
        if "bf16" in p:
            assert p["fp16"] == pytest.approx(p["bf16"], rel=0.05), spec.name
        if "tf32" in p:
            assert p["tf32"] <= p["fp16"], spec.name
        assert p["fp32"] <= p["fp16"], spec.name
        # no entry is a 2:4-sparse figure: dense bf16 never exceeds B200's 2.25 PFLOP/s
        assert p.get("bf16", 0) <= 2.25e15 * 1.001, spec.name


def test_dense_tensor_peaks_keep_their_ratios_across_the_whole_table() -> None:
    # bf16 tensor math runs at twice the tf32 rate on every generation here (Ampere to Blackwell);
    # a 2:4-sparse figure slipped into either column breaks the ratio by 2x. fp16 == bf16 on all.
    # The lower bound is 1.97, not 1.98: the L40S datasheet prints 362.05 bf16 / 183 tf32 (1.978).
    both = [s for s in dev.GPUS if {"bf16", "tf32"} <= set(s.peaks)]
    assert len(both) >= 25, [s.name for s in both]
    for spec in both:
        ratio = spec.peaks["bf16"] / spec.peaks["tf32"]
        assert 1.97 <= ratio <= 2.05, (spec.name, ratio)
    for spec in dev.GPUS:
        if "bf16" in spec.peaks and "fp16" in spec.peaks:
            assert spec.peaks["fp16"] == spec.peaks["bf16"], spec.name
        if "fp8" in spec.peaks:  # fp8 is twice bf16 where the card has both
            assert 1.98 <= spec.peaks["fp8"] / spec.peaks["bf16"] <= 2.05, spec.name


def test_entries_are_built_from_tflops_with_fp16_defaulting_to_bf16() -> None:
    from diag.machine.device import GpuSpec, _g

    spec = _g("X1", ("x1", "x 1"), 24.0, "a datasheet", fp32=10, bf16=40, tf32=20, fp8=80)
    assert isinstance(spec, GpuSpec)
    assert (spec.name, spec.patterns, spec.memory_gb, spec.source) == (
        "X1", ("x1", "x 1"), 24.0, "a datasheet")
    assert spec.peaks == {"bf16": 40 * T, "fp16": 40 * T, "tf32": 20 * T, "fp32": 10 * T,
                          "fp8": 80 * T}
    # a card without bf16 keeps its own fp16; dtypes it lacks are absent, not zero
    assert _g("X2", ("x2",), 16, "s", fp32=8, fp16=65).peaks == {"fp16": 65 * T, "fp32": 8 * T}
    assert _g("X3", ("x3",), 16, "s", fp32=8, bf16=30, fp16=31).peaks["fp16"] == 31 * T


def test_every_pattern_finds_its_own_entry() -> None:
    for spec in dev.GPUS:
        for pattern in spec.patterns:
            assert dev.find_gpu(pattern) is spec, (pattern, spec.name)


@pytest.mark.parametrize(
    "device_name, entry",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB"),
        ("NVIDIA GeForce RTX 4070", "RTX 4070"),
        ("NVIDIA GeForce RTX 4070 Ti", "RTX 4070 Ti"),
        ("NVIDIA GeForce RTX 4070 Ti SUPER", "RTX 4070 Ti SUPER"),
        ("NVIDIA GeForce RTX 4070 SUPER", "RTX 4070 SUPER"),
        ("NVIDIA GeForce RTX 4080 SUPER", "RTX 4080 SUPER"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
        ("Tesla T4", "T4"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2 16GB"),
        ("Tesla V100-SXM2-32GB", "V100 SXM2 32GB"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_device_name_matching(device_name: str, entry: str) -> None:
    spec = dev.find_gpu(device_name)
    assert spec is not None and spec.name == entry


@pytest.mark.parametrize("device_name, entry", [
    ("nvidia_h100_pcie", "H100 PCIe"), ("NVIDIA A100/80GB", "A100 80GB"),
    ("nvidia-l40s", "L40S"), ("TESLA T4", "T4"),
])
def test_names_match_whatever_separates_or_cases_their_words(device_name: str, entry: str) -> None:
    spec = dev.find_gpu(device_name)
    assert spec is not None and spec.name == entry


@pytest.mark.parametrize("name", ["NVIDIA GeForce GTX 1080", "Quadro RTX 6000", "AMD MI300X", ""])
def test_unknown_gpu_is_none_never_a_guess(name: str) -> None:
    assert dev.find_gpu(name) is None
    assert dev.dense_peak_flops(name) is None


def test_dtype_without_tensor_support_is_none() -> None:
    assert dev.dense_peak_flops("Tesla T4", "bf16") is None  # Turing: no bf16 tensor cores
    assert dev.dense_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None


def test_bad_dtype_names_it_and_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="int3.*bf16.*fp8"):
        dev.dense_peak_flops("NVIDIA H100 PCIe", "int3")
    with pytest.raises(ValueError) as err:
        dev.dense_peak_flops("NVIDIA H100 PCIe", "int3")
    assert str(err.value) == "dtype='int3': allowed values are bf16, fp16, tf32, fp32, fp8"
    with pytest.raises(ValueError, match="int3"):
        dev.peak_flops("cpu", "int3")
    assert dev.dense_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756.5 * T)


def test_cpu_probe_times_the_precision_asked_for_repeatedly() -> None:
    samples = dev.cpu_matmul_probe(size=128, repeats=3, dtype="bf16")
    assert len(samples) == 3 and all(1e6 < f < 1e14 for f in samples)
    with pytest.raises(ValueError, match="repeats=0"):
        dev.cpu_matmul_probe(size=128, repeats=0)


def test_peak_flops_on_cpu_is_a_measured_probe_of_that_precision_with_its_spread() -> None:
    from diag.noise import spread

    peak = dev.peak_flops("cpu", "bf16", probe_size=128, repeats=5)
    assert peak.measured and peak.flops and peak.flops > 0 and peak.dtype == "bf16"
    assert peak.label.startswith("measured: CPU bf16 matmul probe (128x128, ")
    assert f"{torch.get_num_threads()} threads, best of 5 per CPU second, spread " in peak.label
    # bf16 at its own probe's best, or at the fp32 probe's where that is faster (said)
    wide = "; its fp32 probe is faster (" in peak.label
    assert (f"spread {peak.spread:.0%})" in peak.label) and peak.spread >= 0
    assert peak.label.endswith(f"spread {peak.spread:.0%}): a bf16 matmul's ceiling on this CPU"
                               if wide else f"spread {peak.spread:.0%})")
    fp32 = dev.peak_flops("cpu", "fp32", probe_size=128)
    assert fp32.dtype == "fp32" and fp32.label.startswith("measured: CPU fp32 matmul probe")
    # a precision no CPU probe times: no figure, said, rather than another precision's
    fp8 = dev.peak_flops("cpu", "fp8", probe_size=128)
    assert fp8.flops is None and fp8.label == "no CPU probe for fp8: one of bf16, fp16, fp32"
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == 2 / 3  # the figure the label shows


def test_sync_and_is_async_on_cpu() -> None:
    assert dev.is_async("cpu") is False
    assert dev.is_async(torch.device("cuda")) is True
    dev.sync("cpu")
    dev.sync(torch.device("cpu"))
    dev.sync()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_resolve_cuda_without_gpu_raises_clearly() -> None:
    with pytest.raises(RuntimeError, match="no CUDA device is visible.*'cpu'.*'auto'"):
        dev.resolve("cuda")
    assert dev.resolve("auto").type == "cpu"


def test_resolve() -> None:
    assert dev.resolve("cpu") == torch.device("cpu")
    assert dev.resolve("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError, match="tpu"):
        dev.resolve("tpu")


def test_run_info_quick() -> None:
    df = dev.run_info(InfoConfig.quick())
    assert list(df.columns) == ["fact", "value", "detail"]
    facts = dict(zip(df["fact"], df["value"]))
    # named for what it holds: the table's dense bf16 on a GPU, the fp32 probe's on a CPU
    peak = "peak_tflops_bf16" if torch.cuda.is_available() else "peak_tflops_fp32"
    for key in ("accelerator", "cpu_model", "cpu_cores_logical", "ram_gb", peak):
        assert key in facts
    assert facts["cpu_cores_logical"] >= 1 and facts["ram_gb"] > 0
    assert df["fact"].is_unique
    assert all(d.startswith("disk:/") for d in df["fact"] if d.startswith("disk:"))
    assert not any(f.startswith("peak_tflops_") and f != peak for f in facts)
    detail = df.set_index("fact").loc[peak, "detail"]
    if not torch.cuda.is_available():
        assert facts["accelerator"] == "none"
        assert facts[peak] > 0 and detail.startswith("measured: CPU fp32")
        assert "256x256" in detail


def test_run_info_without_probe_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("the probe switch only matters on CPU")
    df = dev.run_info(InfoConfig.quick(probe=False)).set_index("fact")
    assert df.loc["peak_tflops_fp32", "value"] is None
    assert "probe" in df.loc["peak_tflops_fp32", "detail"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_lookup_of_running_device() -> None:
    name = torch.cuda.get_device_name(0)
    peak = dev.peak_flops("cuda", "bf16")
    assert not peak.measured
    if dev.find_gpu(name) is None:
        assert peak.flops is None and name in peak.label
    else:
        assert peak.flops == dev.dense_peak_flops(name, "bf16") or peak.flops is None
        assert peak.label.startswith("table:") or "no bf16" in peak.label
    facts = dev.facts(probe=False)
    assert facts["accelerator"] == name and facts["accelerator_memory_gb"] > 0
    dev.sync("cuda")


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Pretend one GPU of this name is visible: exercises the table path on a CPU box."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)


def test_peak_flops_cuda_table_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, "NVIDIA H100 PCIe")
    peak = dev.peak_flops("cuda", "bf16")
    assert peak.flops == pytest.approx(756.5 * T) and not peak.measured
    assert peak.label == "table: H100 PCIe dense bf16" and "datasheet" in peak.source


def test_peak_flops_unknown_gpu_says_pass_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, "NVIDIA Mystery X1")
    peak = dev.peak_flops("cuda")
    assert peak.flops is None and not peak.measured
    assert "'NVIDIA Mystery X1'" in peak.label and "explicitly" in peak.label


def test_cpu_threads_sets_diags_count_on_a_cpu_and_restores_the_callers(monkeypatch) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.delenv(dev.CPU_THREADS_ENV, raising=False)
        with dev.cpu_threads("cpu"):
            assert torch.get_num_threads() == dev.CPU_THREADS_DEFAULT == 1
        assert torch.get_num_threads() == 2
        monkeypatch.setenv(dev.CPU_THREADS_ENV, "2")
        torch.set_num_threads(1)
        with dev.cpu_threads("cpu"):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        seen = []
        wrapped = dev.on_cpu_threads(lambda cfg, x: seen.append((torch.get_num_threads(), x)))
        monkeypatch.setenv(dev.CPU_THREADS_ENV, "1")
        torch.set_num_threads(2)
        wrapped(InfoConfig(), x=3)
        assert seen == [(1, 3)] and torch.get_num_threads() == 2
        for bad in ("0", "two", "-1"):
            monkeypatch.setenv(dev.CPU_THREADS_ENV, bad)
            with pytest.raises(ValueError, match=rf"DIAG_CPU_THREADS='{bad}': must be a whole"), \
                    dev.cpu_threads("cpu"):
                pass
    finally:
        torch.set_num_threads(before)


def test_info_names_the_cpu_threads_of_diags_steps(monkeypatch) -> None:
    # 2, not the tests' own 1 (conftest's OMP_NUM_THREADS): the row shows what run_info set
    monkeypatch.setenv(dev.CPU_THREADS_ENV, "2")
    before = torch.get_num_threads()
    frame = dev.run_info(InfoConfig(probe=False)).set_index("fact")
    assert frame.at["cpu_threads", "value"] == 2 and torch.get_num_threads() == before
    assert "DIAG_CPU_THREADS" in frame.at["cpu_threads", "detail"]
