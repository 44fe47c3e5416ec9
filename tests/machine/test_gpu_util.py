"""diag.machine.contention.GpuSampler: NVML utilisation beside data_wait, or why not."""

from __future__ import annotations

import math
import sys
import time
import types

import pytest
import torch

from diag.config import ToyConfig
from diag.machine.contention import GpuSampler


def test_cpu_run_has_no_gpu_to_sample():
    with GpuSampler("cpu") as util:
        pass
    cols = util.columns()
    assert math.isnan(cols["gpu_util_pct"]) and "not a CUDA run" in cols["gpu_util_note"]


def test_without_nvidia_ml_py_the_note_names_the_extra(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with GpuSampler("cuda") as util:
        pass
    cols = util.columns()
    assert math.isnan(cols["gpu_util_pct"])
    assert cols["gpu_util_note"] == "nvidia-ml-py is not installed: pip install 'diag[gpu]'"


def test_nvml_without_a_driver_says_so(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here: the no-driver path cannot be taken")
    except pynvml.NVMLError:
        pass
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with GpuSampler("cuda") as util:
        pass
    assert util.columns()["gpu_util_note"].startswith("NVML did not start: ")


def test_samples_are_averaged_and_nvml_shut_down(monkeypatch):
    # The sampling loop's logic on a CPU box: an NVML that answers 30 then 90 percent.
    calls: list[str] = []
    answers = iter([30, 90] + [90] * 1000)
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(uuid) or "handle",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=next(answers)))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="1234-abcd"))
    with GpuSampler("cuda:0", interval_s=0.01) as util:
        deadline = time.perf_counter() + 5
        while len(util.samples) < 2 and time.perf_counter() < deadline:
            time.sleep(0.01)
    assert util.samples[:2] == [30.0, 90.0], util.reason
    assert calls[:2] == ["init", "GPU-1234-abcd"] and calls[-1] == "shutdown"
    cols = util.columns()
    assert cols["gpu_util_note"] == "" and 30 <= cols["gpu_util_pct"] <= 90


def test_toy_reports_it_beside_data_wait():
    from diag.loader.toy import run_toy

    frame = run_toy(ToyConfig.quick(steps=2, warmup_steps=1, device="cpu"))
    waits = frame[frame["stage"] == "data_wait"]
    assert len(waits) == 2 and waits["gpu_util_pct"].isna().all()
    assert (waits["gpu_util_note"] == "not a CUDA run (device cpu): no GPU to sample").all()
    assert (frame.loc[frame["stage"] != "data_wait", "gpu_util_note"] == "").all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_busy_gpu_is_sampled():
    pytest.importorskip("pynvml")
    a = torch.randn(4096, 4096, device="cuda")
    with GpuSampler("cuda", interval_s=0.05) as util:
        deadline = time.perf_counter() + 2
        while time.perf_counter() < deadline:
            a @ a
        torch.cuda.synchronize()  # note: sync point, the kernels ran inside the block
    cols = util.columns()
    assert cols["gpu_util_note"] == "" and cols["gpu_util_pct"] > 50
