"""GPU utilisation through NVML (nvidia-ml-py, the `gpu` extra): `with GpuSampler(device) as u:`,
then `u.columns()`: `gpu_util_pct` (NaN when not measured), `gpu_util_note` (why not).
"""

from __future__ import annotations

import threading
from typing import Any


class GpuSampler:
    """One CUDA device's utilisation while the `with` block runs; says why when it can't."""

    def __init__(self, device: Any = None, interval_s: float = 0.1) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r}: must be a number > 0")
        self.device, self.interval_s = device, interval_s
        self.samples: list[float] = []
        self.reason = ""  # why nothing is sampled
        self._stop, self._thread, self._nvml = threading.Event(), None, None

    def _handle(self) -> Any:
        """The NVML handle, or None with self.reason set. By UUID: NVML and CUDA number GPUs
        differently under CUDA_VISIBLE_DEVICES."""
        import torch

        dev = torch.device("cuda" if self.device in (None, "auto") else self.device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            self.reason = f"not a CUDA run (device {dev.type}): no GPU to sample"
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
        except ImportError:
            self.reason = "nvidia-ml-py is not installed: pip install 'diag[gpu]'"
            return None
        except pynvml.NVMLError as err:
            self.reason = f"NVML did not start: {err}"
            return None
        self._nvml = pynvml
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        uuid = "GPU-" + str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")
        for by, key in (("UUID", uuid), ("Index", index)):  # no UUID match: numbered alike?
            try:
                return getattr(pynvml, "nvmlDeviceGetHandleBy" + by)(key)
            except pynvml.NVMLError as err:
                self.reason = f"NVML does not know CUDA device {index}: {err}"
        return None

    def _run(self, handle: Any) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            except self._nvml.NVMLError as err:  # the GPU fell off the bus: keep what we have
                self.reason = f"NVML stopped answering: {err}"
                return

    def __enter__(self) -> GpuSampler:
        handle = self._handle()
        if handle is not None:
            self.reason = ""  # a UUID NVML did not know, found by index
            self._thread = threading.Thread(target=self._run, args=(handle,), daemon=True,
                                            name="diag-gpu-sampler")
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None

    def columns(self) -> dict[str, Any]:
        """gpu_util_pct (the samples' mean, NaN if none) and gpu_util_note (why none)."""
        if not self.samples:
            note = self.reason or f"no sample: the run was shorter than {self.interval_s} s"
            return {"gpu_util_pct": float("nan"), "gpu_util_note": note}
        return {"gpu_util_pct": sum(self.samples) / len(self.samples), "gpu_util_note": ""}
