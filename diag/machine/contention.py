"""The machine's state while diag measures: load, CPU steal, what other processes took.
`with Contention() as c:` samples /proc every `interval_s` (NVML's processes on a GPU);
`busy(c.summary())` says if that could have moved a wall-clock figure. Noisy neighbours: a finding.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

# the box is called busy when other processes took this share of its CPU, or steal this share
BUSY = {"others_share": 0.25, "steal_share": 0.05}


def _cpu_jiffies() -> tuple[float, float, float]:
    """(busy, steal, total) jiffies of every core since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(
            float, f.readline().split()[1:9])
    total = user + nice + system + idle + iowait + irq + softirq + steal
    return total - idle - iowait - steal, steal, total


def _cores() -> int:
    """The CPUs /proc/stat counts (the machine's, which the neighbours share)."""
    with open("/proc/stat") as f:
        return sum(1 for line in f if line.startswith("cpu") and line[3].isdigit())


def _own_seconds() -> float:
    """CPU seconds of this process and its children (the embedded servers, loader workers)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # gone between the listing and the read
            continue
    return total


def _gpu_others(device: Any) -> int | None:
    """Other processes on this run's GPU (NVML), None where there is no GPU or no NVML."""
    if not str(device or "").startswith("cuda"):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(str(device).split(":")[1]) if ":" in str(device) else 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return sum(1 for p in procs if p.pid != os.getpid())
    except Exception:  # noqa: BLE001  no NVML here: the row says None
        return None


class Contention:
    """Samples the machine's state while the `with` block runs (a daemon thread)."""

    def __init__(self, device: Any = None, interval_s: float = 1.0) -> None:
        self.device, self.interval_s = device, interval_s
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Contention:
        self._began = (time.perf_counter(), time.process_time())
        self._last = (time.perf_counter(), _own_seconds(), *_cpu_jiffies())
        self._thread = threading.Thread(target=self._run, daemon=True, name="diag-contention")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sample()  # the last part of the block counts too
        self.wall_s = time.perf_counter() - self._began[0]
        self.cpu_s = time.process_time() - self._began[1]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        now, own, busy, steal, total = time.perf_counter(), _own_seconds(), *_cpu_jiffies()
        t0, own0, busy0, steal0, total0 = self._last
        self._last = (now, own, busy, steal, total)
        if total <= total0:
            return
        tick, span = os.sysconf("SC_CLK_TCK"), total - total0  # the window, in CPU jiffies
        others = max(0.0, (busy - busy0) / tick - (own - own0))
        self.rows.append({"t_s": now - self._began[0], "load_1min": os.getloadavg()[0],
                          "cores": _cores(), "others_share": min(1.0, others * tick / span),
                          "steal_share": (steal - steal0) / span,
                          "gpu_other_processes": _gpu_others(self.device)})

    def frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.rows, columns=["t_s", "load_1min", "cores", "others_share",
                                                "steal_share", "gpu_other_processes"])

    def summary(self) -> dict[str, Any]:
        """Medians over the samples, the largest load, and this process's wall over CPU."""
        if not self.rows:
            return {}
        col = {k: [r[k] for r in self.rows] for k in self.rows[0]}
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
    if not summary:
        return ""
    over = [k for k, limit in BUSY.items() if (summary.get(k) or 0) >= limit]
    gpu = summary.get("gpu_other_processes")
    if not over and not gpu:
        return ""
    said = (f"the machine was busy: load {summary['load_1min']:.1f} on {summary['cores']} cores, "
            f"other processes took {summary['others_share']:.0%} of its CPU"
            + (f", steal {summary['steal_share']:.0%}" if summary["steal_share"] >= 0.005 else "")
            + (f", {gpu} other process{'es' * (gpu != 1)} on the GPU" if gpu else ""))
    ratio = summary.get("wall_over_cpu")
    return said + (f"; diag's wall seconds ran {ratio:.1f}x its CPU seconds" if ratio else "") + (
        f" (busy: others over {BUSY['others_share']:.0%} of the CPU, or steal over "
        f"{BUSY['steal_share']:.0%}): wall-clock figures may have moved with it")
