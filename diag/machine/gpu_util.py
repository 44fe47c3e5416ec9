"""GPU utilisation through NVML (nvidia-ml-py, the `gpu` extra): `with GpuSampler(device) as u:`,
then `u.columns()`: `gpu_util_pct` (NaN when not measured), `gpu_util_note` (why not).
`NvmlSampler` is the sampling thread it shares with `diag attach`'s GPU watch.
"""

from __future__ import annotations

import threading
from typing import Any


class NvmlSampler:
    """A subclass's `_read(nvml, *args)` every `interval_s` on a daemon thread while the `with`
    block runs (the first at once when `eager`); `reason` says why nothing was read."""

    extra, eager = "gpu", False  # the pip extra that installs nvidia-ml-py; read before waiting

    def __init__(self, interval_s: float) -> None:
        self.interval_s, self.reason = interval_s, ""
        self._stop, self._thread, self._nvml = threading.Event(), None, None

    def _nvml_started(self, failed: str = "NVML did not start: {}") -> Any:
        """pynvml after nvmlInit, else None with `reason` set."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except ImportError:
            self.reason = f"nvidia-ml-py is not installed: pip install 'diag[{self.extra}]'"
            return None
        except pynvml.NVMLError as err:
            self.reason = failed.format(err)
            return None
        self._nvml = pynvml
        return pynvml

    def _start(self, *args: Any) -> None:
        self._thread = threading.Thread(target=self._run, args=args, daemon=True,
                                        name="diag-gpu-sampler")
        self._thread.start()

    def _run(self, *args: Any) -> None:
        if self.eager or not self._stop.wait(self.interval_s):
            while True:
                try:
                    self._read(self._nvml, *args)
                except self._nvml.NVMLError as err:  # the GPU fell off the bus: keep what we have
                    self.reason = f"NVML stopped answering: {err}"
                    return
                if self._stop.wait(self.interval_s):
                    return

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


class GpuSampler(NvmlSampler):
    """One CUDA device's utilisation while the `with` block runs; says why when it can't."""

    def __init__(self, device: Any = None, interval_s: float = 0.1) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r}: must be a number > 0")
        super().__init__(interval_s)
        self.device, self.samples = device, []

    def _handle(self) -> Any:
        """The NVML handle (by UUID: NVML and CUDA number GPUs apart), or None with `reason` set."""
        import torch

        dev = torch.device("cuda" if self.device in (None, "auto") else self.device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            self.reason = f"not a CUDA run (device {dev.type}): no GPU to sample"
            return None
        pynvml = self._nvml_started()
        if pynvml is None:
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        uuid = "GPU-" + str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")
        for by, key in (("UUID", uuid), ("Index", index)):  # no UUID match: numbered alike?
            try:
                return getattr(pynvml, "nvmlDeviceGetHandleBy" + by)(key)
            except pynvml.NVMLError as err:
                self.reason = f"NVML does not know CUDA device {index}: {err}"
        return None

    def _read(self, nvml: Any, handle: Any) -> None:
        self.samples.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))

    def __enter__(self) -> GpuSampler:
        handle = self._handle()
        if handle is not None:
            self.reason = ""  # a UUID NVML did not know, found by index
            self._start(handle)
        return self

    def columns(self) -> dict[str, Any]:
        """gpu_util_pct (the samples' mean, NaN if none) and gpu_util_note (why none)."""
        if not self.samples:
            note = self.reason or f"no sample: the run was shorter than {self.interval_s} s"
            return {"gpu_util_pct": float("nan"), "gpu_util_note": note}
        return {"gpu_util_pct": sum(self.samples) / len(self.samples), "gpu_util_note": ""}
