"""The machine's state while diag measures, each a `Sampler` (a daemon thread reading every
`interval_s` while its `with` block runs): `Contention` samples /proc (load, CPU steal, other
processes' CPU; NVML's processes on a GPU) and `busy(c.summary())` says if that could have moved
a wall-clock figure; through NVML, `GpuSampler` a GPU's utilisation, `Watch(pid)` a job's GPUs.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from typing import Any, Self

import pandas as pd
import psutil

# the box is called busy when other processes took this share of its CPU, or steal this share
BUSY = {"others_share": 0.25, "steal_share": 0.05}


def _cpu_seconds() -> tuple[float, float, float]:
    """(busy, steal, total) CPU seconds of every core since boot (guest time is in user's)."""
    t = psutil.cpu_times()
    total = sum(t[:8])  # user, nice, system, idle, iowait, irq, softirq, steal
    return total - t.idle - t.iowait - t.steal, t.steal, total


def family(pid: int) -> list[Any]:
    """psutil's process pid and its children (none where pid is gone)."""
    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def counters(pid: int) -> dict[int, tuple[str, float, float, float]]:
    """pid -> (role, CPU s, MB read, MB written) of pid and its children (unreadable I/O: NaN)."""
    out = {}
    for p in family(pid):
        with contextlib.suppress(psutil.Error):  # gone between the listing and the read
            cpu = p.cpu_times()
            try:
                io = p.io_counters()
                read, written = io.read_bytes / 1e6, io.write_bytes / 1e6
            except (psutil.Error, AttributeError):
                read = written = math.nan
            out[p.pid] = ("main" if p.pid == pid else "child", cpu.user + cpu.system, read, written)
    return out


def _own_seconds() -> float:
    """CPU seconds of this process and its children (the embedded servers, loader workers)."""
    return sum(cpu for _, cpu, _, _ in counters(os.getpid()).values())


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


class Sampler:
    """`_read(*args)` every `interval_s` on a daemon thread in the `with`, args from `_begin()`
    (None: no thread; `reason` says why)."""

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

    def __enter__(self) -> Self:
        args = self._begin()
        if args is not None:
            self._thread = threading.Thread(target=self._run, args=args, daemon=True,
                                            name=f"diag-{type(self).__name__.lower()}")
            self._thread.start()
        return self

    def _run(self, *args: Any) -> None:
        failed = self._nvml.NVMLError if self._nvml is not None else ()
        if self.eager or not self._stop.wait(self.interval_s):
            while True:
                try:
                    self._read(*args)
                except failed as err:  # the GPU fell off the bus: keep what we have
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


class Contention(Sampler):
    """Samples the machine's state while the `with` block runs."""

    def __init__(self, device: Any = None, interval_s: float = 1.0) -> None:
        super().__init__(interval_s)
        self.device, self.rows = device, []

    def _begin(self) -> tuple:
        self._began = (time.perf_counter(), time.process_time())
        self._last = (_own_seconds(), *_cpu_seconds())
        return ()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__()
        self._read()  # the last part of the block counts too
        self.wall_s = time.perf_counter() - self._began[0]
        self.cpu_s = time.process_time() - self._began[1]

    def _read(self) -> None:
        now, (own, busy, steal, total) = time.perf_counter(), (_own_seconds(), *_cpu_seconds())
        own0, busy0, steal0, total0 = self._last
        self._last = (own, busy, steal, total)
        span = total - total0  # the window, in CPU seconds of every core
        if span <= 0:
            return
        others = max(0.0, busy - busy0 - (own - own0))
        self.rows.append({"t_s": now - self._began[0], "load_1min": os.getloadavg()[0],
                          "cores": os.cpu_count() or 1,  # the machine's, which neighbours share
                          "others_share": min(1.0, others / span),
                          "steal_share": (steal - steal0) / span,
                          "gpu_other_processes": _gpu_others(self.device)})

    def frame(self) -> pd.DataFrame:
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


class GpuSampler(Sampler):
    """One CUDA device's utilisation while the `with` block runs; says why when it can't."""

    def __init__(self, device: Any = None, interval_s: float = 0.1) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r}: must be a number > 0")
        super().__init__(interval_s)
        self.device, self.samples = device, []

    def _begin(self) -> tuple | None:
        """(NVML's handle,) by UUID (NVML and CUDA number GPUs apart), or None with `reason` set."""
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
                handle = getattr(pynvml, "nvmlDeviceGetHandleBy" + by)(key)
            except pynvml.NVMLError as err:
                self.reason = f"NVML does not know CUDA device {index}: {err}"
            else:
                self.reason = ""  # a UUID NVML did not know, found by index
                return (handle,)
        return None

    def _read(self, handle: Any) -> None:
        self.samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu))

    def columns(self) -> dict[str, Any]:
        """gpu_util_pct (the samples' mean, NaN if none) and gpu_util_note (why none)."""
        if not self.samples:
            note = self.reason or f"no sample: the run was shorter than {self.interval_s} s"
            return {"gpu_util_pct": float("nan"), "gpu_util_note": note}
        return {"gpu_util_pct": sum(self.samples) / len(self.samples), "gpu_util_note": ""}


class Watch(Sampler):
    """`with Watch(pid):` NVML samples the GPUs pid's family holds; `frame()`: what, or why not."""

    extra, eager = "attach", True

    def __init__(self, pid: int) -> None:
        super().__init__(0.5)  # NVML's reading of the job's GPUs
        self.pid, self.rows = pid, []

    def _begin(self) -> tuple | None:
        return () if self._nvml_started("no NVIDIA GPU seen (NVML: {})") is not None else None

    def _read(self) -> None:
        nvml, pids = self._nvml, {self.pid, *(p.pid for p in family(self.pid))}
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            held = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid in pids]
            if held:
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                self.rows.append((i, str(nvml.nvmlDeviceGetName(handle)), float(util.gpu),
                                   float(util.memory),
                                   sum(p.usedGpuMemory or 0 for p in held) / 1e9))

    def frame(self) -> pd.DataFrame:
        if not self.rows:
            return pd.DataFrame([[-1, "", 0, float("nan"), float("nan"), float("nan"),
                                  self.reason or "the job held no GPU NVML could see (in a "
                                  "container, NVML lists the host's PIDs)"]], columns=[
                "gpu", "name", "samples", "util_pct", "memory_util_pct", "job_memory_gb", "note"])
        rows = pd.DataFrame(self.rows, columns=["gpu", "name", "util", "memory", "gb"])
        return rows.groupby(["gpu", "name"], as_index=False).agg(
            samples=("util", "size"), util_pct=("util", "mean"), memory_util_pct=(
                "memory", "mean"), job_memory_gb=("gb", "max")).assign(note=self.reason)
