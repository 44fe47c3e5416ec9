"""What the GPUs did while a job was sampled: NVML (nvidia-ml-py) finds the devices the job's
processes hold and reads their utilisation and the job's memory every INTERVAL_S."""

from __future__ import annotations

import threading
from typing import Any

import pandas as pd

INTERVAL_S = 0.5
COLUMNS = ["gpu", "name", "samples", "util_pct", "memory_util_pct", "job_memory_gb", "note"]


def family(pid: int) -> list[Any]:
    """psutil's process pid and its children (none where pid is gone)."""
    import psutil

    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


class Watch:
    """`with Watch(pid) as gpu:` samples the GPUs pid or its children hold; `frame()` says what
    it saw, or in its note why nothing."""

    def __init__(self, pid: int) -> None:
        self.pid, self.reason, self._nvml = pid, "", None
        self._rows: list[tuple[int, str, float, float, float]] = []
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
        nvml = self._nvml
        while True:
            pids = {self.pid, *(p.pid for p in family(self.pid))}
            try:
                for i in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(i)
                    held = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                            if p.pid in pids]
                    if held:
                        util = nvml.nvmlDeviceGetUtilizationRates(handle)
                        self._rows.append((i, str(nvml.nvmlDeviceGetName(handle)),
                                           float(util.gpu), float(util.memory),
                                           sum(p.usedGpuMemory or 0 for p in held) / 1e9))
            except nvml.NVMLError as err:  # keep what was read; say why it stopped
                self.reason = f"NVML stopped answering: {err}"
                return
            if self._stop.wait(INTERVAL_S):
                return

    def known_name(self) -> str:
        """The name of the first GPU the job held ("" for none), for the upgrade projection."""
        return self._rows[0][1] if self._rows else ""

    def frame(self) -> pd.DataFrame:
        if not self._rows:
            return pd.DataFrame([[-1, "", 0, float("nan"), float("nan"), float("nan"),
                                  self.reason or "the job held no GPU NVML could see (in a "
                                  "container, NVML lists the host's PIDs)"]], columns=COLUMNS)
        rows = pd.DataFrame(self._rows, columns=["gpu", "name", "util", "memory", "gb"])
        return rows.groupby(["gpu", "name"], as_index=False).agg(
            samples=("util", "size"), util_pct=("util", "mean"), memory_util_pct=(
                "memory", "mean"), job_memory_gb=("gb", "max")).assign(note=self.reason)[COLUMNS]
