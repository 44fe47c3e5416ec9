"""What the GPUs did while a job was sampled: NVML (nvidia-ml-py) finds the devices the job's
processes hold and reads their utilisation and the job's memory every INTERVAL_S."""

from __future__ import annotations

import threading
from typing import Any

import pandas as pd

INTERVAL_S = 0.5
COLUMNS = ["gpu", "name", "samples", "util_pct", "memory_util_pct", "job_memory_gb", "note"]


class Watch:
    """`with Watch(pid) as gpu:` samples the GPUs pid or its children hold; `frame()` says what
    it saw, or in its note why nothing."""

    def __init__(self, pid: int) -> None:
        self.pid, self.reason, self._nvml = pid, "", None
        self._seen: dict[int, tuple[str, list[tuple[float, float, float]]]] = {}
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run,
                                                                       daemon=True)

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
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._nvml is not None:
            self._thread.join()
            self._nvml.nvmlShutdown()

    def _run(self) -> None:
        import psutil

        nvml = self._nvml
        while True:
            try:
                main = psutil.Process(self.pid)
                family = {self.pid, *(p.pid for p in main.children(recursive=True))}
            except psutil.Error:
                family = {self.pid}
            try:
                for i in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(i)
                    held = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                            if p.pid in family]
                    if held:
                        util = nvml.nvmlDeviceGetUtilizationRates(handle)
                        _, got = self._seen.setdefault(i, (nvml.nvmlDeviceGetName(handle), []))
                        got.append((float(util.gpu), float(util.memory),
                                    sum(p.usedGpuMemory or 0 for p in held) / 1e9))
            except nvml.NVMLError as err:  # keep what was read; say why it stopped
                self.reason = f"NVML stopped answering: {err}"
                return
            if self._stop.wait(INTERVAL_S):
                return

    def known_name(self) -> str:
        """The name of the first GPU the job held ("" for none), for the upgrade projection."""
        return next((str(name) for name, _ in self._seen.values()), "")

    def frame(self) -> pd.DataFrame:
        rows = [[i, str(name), len(got), *(sum(g[k] for g in got) / len(got) for k in (0, 1)),
                 max(g[2] for g in got), self.reason]
                for i, (name, got) in sorted(self._seen.items())]
        return pd.DataFrame(rows or [[-1, "", 0, float("nan"), float("nan"), float("nan"),
                                      self.reason or "the job held no GPU NVML could see (in "
                                      "a container, NVML lists the host's PIDs)"]],
                            columns=COLUMNS)
