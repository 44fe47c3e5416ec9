"""`diag attach PID` and `diag trace FILE...`: a job diag did not start (diag.observe)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from diag.config.base import ExperimentConfig
from diag.config.general import check_gpu


@dataclass
class _Gpus(ExperimentConfig):
    current_gpu: str = ""  # the GPU the job ran on, for the upgrade
                           # projection; "" = the one NVML saw (attach)
    target_gpu: str = "H100 SXM"  # the GPU the projection compares it with

    def validate(self) -> None:
        for name in ("current_gpu", "target_gpu"):
            check_gpu(getattr(self, name), f"--{name.replace('_', '-')}")


@dataclass
class AttachConfig(_Gpus):
    """Sample a running training process: its stages, its workers, its GPUs, its /proc."""

    pid: int = 0  # the training process (its DataLoader workers are sampled with it)
    seconds: float = 60.0  # how long to sample; the job runs on, never paused or signalled
    rate: int = 100  # samples per second (py-spy --rate, at random intervals); more resolve
                     # smaller stages

    POSITIONAL: ClassVar[tuple[str, ...]] = ("pid",)
    QUICK: ClassVar[dict[str, Any]] = {"seconds": 5.0}

    def validate(self) -> None:
        super().validate()
        if isinstance(self.pid, bool) or not isinstance(self.pid, int) or self.pid <= 0:
            raise ValueError(f"AttachConfig.pid={self.pid!r}: the process id of a running "
                             "training script (a whole number > 0; ps or nvidia-smi shows it)")
        self._positive("seconds")
        if isinstance(self.rate, bool) or not isinstance(self.rate, int) \
                or not 1 <= self.rate <= 1000:
            raise ValueError(f"AttachConfig.rate={self.rate!r}: a whole number of samples per "
                             "second in [1, 1000]")


@dataclass
class TraceConfig(_Gpus):
    """Read torch.profiler traces (Kineto JSON or .json.gz), one file per rank."""

    files: list[str] = field(default_factory=list)  # the traces, one per rank of one run

    POSITIONAL: ClassVar[tuple[str, ...]] = ("files",)

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.files, (list, tuple)) or not self.files:
            raise ValueError("TraceConfig.files=[]: name at least one torch.profiler trace "
                             "(.json or .json.gz)")
        missing = [f for f in self.files if not Path(f).is_file()]
        if missing:
            raise ValueError(f"TraceConfig.files: {missing[0]!r} is not a file")
