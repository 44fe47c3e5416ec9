"""The machine's state while diag measures: its load, CPU steal, what other processes took.

`with Contention() as c:` samples every `interval_s` (and NVML's processes on a GPU);
`c.summary()` says how busy the box was and `busy(summary)` whether that could have moved a
wall-clock figure (BUSY, stated once). Noisy neighbours and steal on a shared instance are a cause
of slow training too: a finding, not only a caveat.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

# the box is called busy when other processes took this share of its CPU, or steal this share
BUSY = {"others_share": 0.25, "steal_share": 0.05}
COLUMNS = ["t_s", "load_1min", "cores", "others_share", "steal_share", "gpu_other_processes"]


def _state() -> tuple[float, float, float, float, float]:
    """(now, this process's and its children's CPU s, every core's busy, steal and total CPU s
    since boot); the children: the embedded servers, loader workers."""
    import psutil

    me, t = psutil.Process(), psutil.cpu_times()
    own = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            own += sum(child.cpu_times()[:2])
        except psutil.Error:  # gone between the listing and the read
            continue
    total = sum(t[:8])  # guest time is inside user already
    return time.perf_counter(), own, total - t.idle - t.iowait - t.steal, t.steal, total


def _own_seconds() -> float:
    return _state()[1]


def _gpu_others(device: Any) -> int | None:
    """Other processes on this run's GPU (NVML), None where there is no GPU or no NVML."""
    if not str(device or "").startswith("cuda"):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(str(device).split(":")[1]) if ":" in str(device) else 0
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(
            pynvml.nvmlDeviceGetHandleByIndex(index))
        return sum(1 for p in procs if p.pid != os.getpid())
    except Exception:  # noqa: BLE001  no NVML here: the row says None
        return None


class Contention:
    """Samples the machine's state while the `with` block runs (a daemon thread)."""

    def __init__(self, device: Any = None, interval_s: float = 1.0) -> None:
        self.device, self.interval_s = device, interval_s
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="diag-contention")

    def __enter__(self) -> Contention:
        self._began, self._last = (time.perf_counter(), time.process_time()), _state()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()  # the last part of the block counts too
        self.wall_s = time.perf_counter() - self._began[0]
        self.cpu_s = time.process_time() - self._began[1]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        (_, own0, busy0, steal0, total0), self._last = self._last, _state()
        now, own, busy, steal, total = self._last
        span = total - total0  # the window in CPU seconds, read with the rest (not the clock)
        if span <= 0:
            return
        others = max(0.0, busy - busy0 - (own - own0))
        self.rows.append(dict(zip(COLUMNS, (
            now - self._began[0], os.getloadavg()[0], os.cpu_count() or 1,  # the machine's
            min(1.0, others / span), (steal - steal0) / span, _gpu_others(self.device)))))

    def frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.rows, columns=COLUMNS)

    def summary(self) -> dict[str, Any]:
        """Medians over the samples, the largest load, and this process's wall over CPU."""
        if not self.rows:
            return {}
        col = {k: [r[k] for r in self.rows] for k in COLUMNS}
        gpu = [g for g in col["gpu_other_processes"] if g is not None]
        return {"load_1min": statistics.median(col["load_1min"]),
                "load_max": max(col["load_1min"]), "cores": max(col["cores"]),
                "others_share": statistics.median(col["others_share"]),
                "steal_share": statistics.median(col["steal_share"]),
                "gpu_other_processes": max(gpu) if gpu else None,
                "wall_over_cpu": self.wall_s / self.cpu_s if self.cpu_s > 0 else None,
                "samples": len(self.rows)}


def busy(summary: dict[str, Any]) -> str:
    """A sentence when the box was busy enough to move a wall-clock figure (BUSY), else ''."""
    gpu = summary.get("gpu_other_processes")
    if not summary or not gpu and all((summary.get(k) or 0) < v for k, v in BUSY.items()):
        return ""
    ratio = summary.get("wall_over_cpu")
    return (f"the machine was busy: load {summary['load_1min']:.1f} on {summary['cores']} cores, "
            f"other processes took {summary['others_share']:.0%} of its CPU"
            + (f", steal {summary['steal_share']:.0%}" if summary["steal_share"] >= 0.005 else "")
            + (f", {gpu} other process{'es' * (gpu != 1)} on the GPU" if gpu else "")
            + (f"; diag's wall seconds ran {ratio:.1f}x its CPU seconds" if ratio else "")
            + f" (busy: others over {BUSY['others_share']:.0%} of the CPU, or steal over "
            f"{BUSY['steal_share']:.0%}): wall-clock figures may have moved with it")
