"""What the GPUs did while a job was sampled: NVML (nvidia-ml-py) finds the devices the job's
processes hold and reads their utilisation and the job's memory every INTERVAL_S."""

from __future__ import annotations

import threading
from typing import Any

import pandas as pd

INTERVAL_S = 0.5
COLUMNS = ["gpu", "name", "samples", "util_pct", "memory_util_pct", "job_memory_gb", "note"]


class Watch:
    """`with Watch(pid) as gpu:` samples the GPUs pid (or its children) holds; `frame()` says
    what it saw, or in its note why nothing."""

    def __init__(self, pid: int) -> None:
        self.pid, self.reason = pid, ""
        self._nvml: Any = None
        self._seen: dict[int, tuple[str, list[tuple[float, float, float]]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed: pip install 'diag[attach]'"
            return self
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:  # no driver, no GPU: a CPU box
            self.reason = f"no NVIDIA GPU seen (NVML: {err})"
            return self
        self._nvml = pynvml
        self._thread = threading.Thread(target=self._run, daemon=True, name="diag-attach-gpu")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()

    def _family(self) -> set[int]:
        import psutil

        try:
            main = psutil.Process(self.pid)
            return {self.pid, *(p.pid for p in main.children(recursive=True))}
        except psutil.Error:
            return {self.pid}

    def _run(self) -> None:
        nvml = self._nvml
        while True:
            family = self._family()
            try:
                for i in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(i)
                    held = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                            if p.pid in family]
                    if not held:
                        continue
                    util = nvml.nvmlDeviceGetUtilizationRates(handle)
                    memory = sum(p.usedGpuMemory or 0 for p in held) / 1e9
                    name, got = self._seen.setdefault(i, (nvml.nvmlDeviceGetName(handle), []))
                    got.append((float(util.gpu), float(util.memory), memory))
            except nvml.NVMLError as err:  # keep what was read; say why it stopped
                self.reason = f"NVML stopped answering: {err}"
                return
            if self._stop.wait(INTERVAL_S):
                return

    def known_name(self) -> str:
        """The name of the first GPU the job held ("" for none), for the upgrade projection."""
        return next((str(name) for name, _ in self._seen.values()), "")

    def frame(self) -> pd.DataFrame:
        rows = [{"gpu": i, "name": str(name), "samples": len(got),
                 "util_pct": sum(g[0] for g in got) / len(got),
                 "memory_util_pct": sum(g[1] for g in got) / len(got),
                 "job_memory_gb": max(g[2] for g in got), "note": self.reason}
                for i, (name, got) in sorted(self._seen.items())]
        if not rows:
            rows = [{"gpu": -1, "name": "", "samples": 0, "util_pct": float("nan"),
                     "memory_util_pct": float("nan"), "job_memory_gb": float("nan"),
                     "note": self.reason or "the job held no GPU NVML could see (in a "
                     "container, NVML lists host PIDs)"}]
        return pd.DataFrame(rows, columns=COLUMNS)
