"""`diag attach PID` and `diag trace FILE...`: a job diag did not start (diag.observe)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from diag.config.base import ExperimentConfig, whole
from diag.config.general import check_gpus


@dataclass
class _Gpus(ExperimentConfig):
    current_gpu: str = ""  # the GPU the job ran on, for the upgrade
                           # projection; "" = the one NVML saw (attach)
    target_gpu: str = "H100 SXM"  # the GPU the projection compares it with

    def validate(self) -> None:
        check_gpus(self)


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
        self._check(("pid",), lambda v: whole(v) and v > 0, "the process id of a running "
                    "training script (a whole number > 0; ps or nvidia-smi shows it)")
        self._positive("seconds")
        self._check(("rate",), lambda v: whole(v) and 1 <= v <= 1000, "a whole number of "
                    "samples per second in [1, 1000]")


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
