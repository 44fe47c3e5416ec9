"""The configs that are not one experiment: `diag info`, `toy`, `report`, `run`, and `attach PID`
/ `trace FILE...` (a job diag did not start, diag.observe)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from diag.config.base import ExperimentConfig, whole
from diag.config.qlora import QLoraPlan
from diag.config.source import ModelLoadConfig, SourceConfig, StorageConfig, check_out

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


@dataclass
class InfoConfig(ExperimentConfig):
    """`diag info`: what this machine is: accelerator, dense peak FLOP/s, CPU, RAM, disks."""

    probe: bool = True  # time a matmul on CPU for a measured peak (the table has no CPUs)
    probe_size: int = 1024  # matrix side of the CPU probe; larger is steadier and slower

    QUICK: ClassVar[dict[str, Any]] = {"probe_size": 256}

    def validate(self) -> None:
        self._positive("probe_size")


@dataclass
class ToyConfig(ExperimentConfig):
    """`diag toy`: a timed toy training loop: data_wait, h2d and compute per step."""

    steps: int = 50  # optimizer steps timed (after warmup_steps)
    warmup_steps: int = 5  # untimed first steps: allocator, kernel selection
    batch_size: int = 32  # samples per step
    width: int = 512  # hidden width of the toy MLP; compute grows with width^2
    prep_ms: float = 0.0  # synthetic per-batch preprocessing cost, to make data_wait visible
    prep: Literal["sleep", "busy"] = "sleep"  # prep_ms asleep (like I/O) or busy (tokenizing)
    num_workers: int = 0  # DataLoader workers; more overlap preprocessing with compute
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:N"
    batch_norm: bool = False  # a BatchNorm layer (under DDP: a broadcast every forward)
    slow_rank: int = -1  # under torchrun: its loader sleeps slow_ms more per batch; -1: none
    slow_ms: float = 0.0  # slow_rank's extra sleep per batch (a straggler on purpose), in ms

    QUICK: ClassVar[dict[str, Any]] = {"steps": 10, "warmup_steps": 2, "width": 128}

    def validate(self) -> None:
        self._positive("steps", "batch_size", "width")
        self._non_negative("warmup_steps", "prep_ms", "num_workers")


@dataclass
class ReportConfig(ExperimentConfig):
    """`diag report`: re-render a run folder's figures and report.html from its CSVs."""

    folder: str = ""  # the run folder, e.g. runs/20261130T120000Z

    POSITIONAL: ClassVar[tuple[str, ...]] = ("folder",)

    def validate(self) -> None:
        self._check(("folder",), bool, "name a run folder (e.g. runs/<timestamp>)")


@dataclass
class DiagnoseConfig(SourceConfig):
    """`diag run`: the whole diagnosis on one source: every experiment, then the report."""

    out: str = ""  # run folder to write; "" makes runs/<UTC timestamp>/
    storage: bool = True  # run the storage experiment (object store vs local disk)
    model_load: bool = True  # run the model-load experiment (fresh vs cached)
    accum: bool = True  # micro-batch x grad-accum sweep of the QLoRA step (--no-qlora: tiny model)
    loader: bool = True  # data-loader sweep against the QLoRA step (--no-qlora: target_gpu's)
    records: int = 0  # records the QLoRA job trains on; 0 = QLoraConfig's default
    job_steps: int = 0  # optimizer steps of each QLoRA plan; 0 = QLoraConfig's default
    seq_len: int = 0  # token slots per row of the QLoRA job; 0 = QLoraConfig's default
    epochs: int = 1  # epochs over every record of --source the headline projects per plan
    train: bool = False  # then `diag train` the optimized plan: adapter in train/<UTC timestamp>
    on_error: str = "raise"  # a record that does not fit: "raise" stops, "skip" counts it
    steps: int = 60  # --no-qlora only: timed steps of the toy loop per run (naive and optimized)
    prep_ms: float = 3.0  # --no-qlora only: the toy loop's host preprocessing per batch
    qlora: bool = True  # naive vs optimized runs are the QLoRA job; False = the toy loop
    naive_workers: int = 0  # --no-qlora only: the toy loop's DataLoader workers, naive
    optimized_workers: int = 2  # --no-qlora only: the toy loop's DataLoader workers, optimized
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:N"
    current_gpu: str = ""  # GPU marked "now" on the Amdahl curve; "" = the detected one
    target_gpu: str = "H100 SXM"  # GPU you consider renting, marked at its dense-peak ratio
    quick_experiments: bool = False  # each experiment in its test-sized variant (seconds)
    budget: str = ""  # time the diagnosis may take (15m, 1h30m); "" = 15m GPU, 3m CPU, 1m --quick
    land: bool = False  # storage lands the whole dataset (miss, then hit); False: hit estimated
    # the panel's sweep ranges and plan (diag.widgets)
    workers: list[int] = field(default_factory=list)  # num_workers the loader sweeps; [] = default
    micro_batches: list[int] = field(default_factory=list)  # accum micro-batches; [] = default
    plan: QLoraPlan = "both"  # QLoRA plans run: "naive", "optimized" or "both"

    QUICK: ClassVar[dict[str, Any]] = {"steps": 12, "prep_ms": 2.0, "quick_experiments": True}

    def validate(self) -> None:
        super().validate()  # the source flags (SourceConfig)
        check_out(self.out)  # a full folder fails now, not at the end
        self._positive("steps", "epochs")
        if self.budget:
            duration_s(self.budget)
        self._non_negative("prep_ms", "naive_workers", "optimized_workers", "records",
                           "job_steps", "seq_len")
        if self.records and self.job_steps > self.records:
            raise ValueError(f"--job-steps={self.job_steps}: at most --records={self.records} "
                             "(each optimizer step needs at least one record)")
        self._wholes("workers", 0, " ([] = the experiment's default)")
        self._wholes("micro_batches", 1, " ([] = the experiment's default)")

    def storage_config(self, budget_s: float = 0.0) -> StorageConfig:
        """The storage experiment on this source, its sample sized to budget_s (0: no limit)."""
        preset = {} if self.quick_experiments else StorageConfig.RUN
        return StorageConfig.default(quick=self.quick_experiments or None, budget_s=budget_s,
                                     land=self.land, **self.source_kwargs(StorageConfig), **preset)

    def model_load_config(self) -> ModelLoadConfig:
        """The model-load experiment on this model, fresh loads estimated (quick: 2 scenarios)."""
        quick = {"scenarios": ["fresh", "cached"]} if self.quick_experiments else {}
        return ModelLoadConfig.default(quick=self.quick_experiments or None, estimate_fresh=True,
                                       **self.source_kwargs(ModelLoadConfig), **quick)


def duration_s(text: str, name: str = "DiagnoseConfig.budget") -> float:
    """A duration in seconds: "15m", "90s", "1h30m", "2.5m" or a bare number of seconds."""
    got = _DURATION.fullmatch(str(text).strip().lower())
    if not str(text).strip() or got is None:
        raise ValueError(f"{name}={text!r}: a duration such as 15m, 90s, 1h30m or 600 (seconds)")
    total = sum(float(v) * unit for v, unit in zip(got.groups(), _UNITS.values()) if v)
    if not total > 0:
        raise ValueError(f"{name}={text!r}: must be more than 0 (e.g. 15m)")
    return total


@dataclass
class _Gpus(ExperimentConfig):
    current_gpu: str = ""  # the job's GPU, for the upgrade projection; "" = what NVML saw (attach)
    target_gpu: str = "H100 SXM"  # the GPU the projection compares it with


@dataclass
class AttachConfig(_Gpus):
    """`diag attach`: sample a running training process (py-spy, NVML, /proc; never paused or
    signalled): its stages, its workers' hot functions, its GPUs."""

    pid: int = 0  # the training process (its DataLoader workers are sampled with it)
    seconds: float = 60.0  # how long to sample; the job runs on, never paused or signalled
    rate: int = 100  # samples a second (py-spy --rate, at random); more resolve smaller stages

    POSITIONAL: ClassVar[tuple[str, ...]] = ("pid",)
    QUICK: ClassVar[dict[str, Any]] = {"seconds": 5.0}

    def validate(self) -> None:
        self._check(("pid",), lambda v: whole(v) and v > 0, "the process id of a running training "
                    "script (a whole number > 0; ps or nvidia-smi shows it)")
        self._positive("seconds")
        self._check(("rate",), lambda v: whole(v) and 1 <= v <= 1000,
                    "a whole number of samples per second in [1, 1000]")


@dataclass
class TraceConfig(_Gpus):
    """`diag trace`: read torch.profiler traces (Kineto .json or .json.gz, one per rank): stages
    per rank, GPU idle time, stragglers."""

    files: list[str] = field(default_factory=list)  # the traces, one per rank of one run

    POSITIONAL: ClassVar[tuple[str, ...]] = ("files",)

    def validate(self) -> None:
        self._check(("files",), lambda v: isinstance(v, (list, tuple)) and bool(v),
                    "name at least one torch.profiler trace (.json or .json.gz)")
        if missing := [f for f in self.files if not Path(f).is_file()]:
            raise ValueError(f"TraceConfig.files: {missing[0]!r} is not a file")
