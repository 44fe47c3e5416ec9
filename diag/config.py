"""One dataclass per experiment: literal defaults with a comment each, `quick()` for tests.

Every experiment takes its config as its only argument; the CLI builds `--key value` flags from
the same fields, so notebooks and the command line share one set of names and defaults.
Validation happens in `__post_init__` and names the field and what is allowed.
`DIAG_QUICK=1` (read here only) makes `default()` return the `quick()` variant; `DIAG_HOME` is
where diag keeps what it makes (the embedded dataset, model, hub and caches).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="ExperimentConfig")

# Names every layer shares, defined once (the CLI offers them as choices).
DEVICES = ("auto", "cpu", "cuda")  # "cuda:N" is also accepted where a device is asked for
MODEL_LOAD_SCENARIOS = ("fresh", "cached", "cached_offline", "cached_cold")
STORAGE_PULLS = ("boto3_default", "boto3_tuned", "s5cmd")
VERIFY_MODES = ("sha256", "size")  # how land() checks a landed copy before reusing it


def quick_mode() -> bool:
    """True when DIAG_QUICK is set to anything but '', '0', 'false' or 'no'."""
    return os.environ.get("DIAG_QUICK", "").strip().lower() not in ("", "0", "false", "no")


def diag_home() -> Path:
    """Where diag keeps generated assets and caches: $DIAG_HOME, else ~/.cache/diag."""
    home = os.environ.get("DIAG_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "diag"


@dataclass
class ExperimentConfig:
    """Base of every experiment config: validation, quick variant, dict round-trip."""

    # overrides applied by quick(): the test-sized variant of this experiment
    QUICK: ClassVar[dict[str, Any]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and what is allowed. Subclasses extend."""

    @classmethod
    def quick(cls: type[T], **overrides: Any) -> T:
        """The test-sized variant: seconds, not minutes."""
        return cls(**{**cls.QUICK, **overrides})

    @classmethod
    def default(cls: type[T], quick: bool | None = None, **overrides: Any) -> T:
        """The full defaults, or quick() when `quick` is True (None: DIAG_QUICK decides)."""
        quick = quick_mode() if quick is None else quick
        return cls.quick(**overrides) if quick else cls(**overrides)

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    # -- checks shared by every experiment ------------------------------------------------
    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{type(self).__name__}.{name}={value!r}: must be a number > 0")

    def _non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{type(self).__name__}.{name}={value!r}: must be a number >= 0")

    def _choice(self, name: str, allowed: tuple[Any, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(
                f"{type(self).__name__}.{name}={value!r}: allowed values are "
                + ", ".join(repr(a) for a in allowed)
            )

    def _device(self, name: str = "device") -> None:
        value = getattr(self, name)
        head, colon, index = str(value).partition(":")
        if head not in DEVICES or (colon and (head != "cuda" or not index.isdigit())):
            raise ValueError(f"{type(self).__name__}.{name}={value!r}: allowed values are "
                             + ", ".join(map(repr, DEVICES)) + " and 'cuda:N'")

    def _positive_list(self, name: str) -> None:
        values = getattr(self, name)
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"{type(self).__name__}.{name}={values!r}: must be a non-empty list")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(
                    f"{type(self).__name__}.{name}={values!r}: every value must be a number > 0"
                )


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


@dataclass
class InfoConfig(ExperimentConfig):
    """`diag info`: what this machine is."""

    probe: bool = True  # time a matmul on CPU to report a measured peak (no table entry for CPUs)
    probe_size: int = 1024  # matrix side of the CPU probe; larger is steadier and slower

    QUICK: ClassVar[dict[str, Any]] = {"probe_size": 256}

    def validate(self) -> None:
        self._positive("probe_size")


@dataclass
class ToyConfig(ExperimentConfig):
    """A timed toy training loop: the smallest run that exercises every step-level stage."""

    steps: int = 50  # optimizer steps timed (after warmup_steps)
    warmup_steps: int = 5  # untimed first steps: allocator, kernel selection
    batch_size: int = 32  # samples per step
    width: int = 512  # hidden width of the toy MLP; compute grows with width^2
    prep_ms: float = 0.0  # synthetic per-batch preprocessing cost, to make data_wait visible
    num_workers: int = 0  # DataLoader workers; more overlap preprocessing with compute
    device: str = "auto"  # "auto", "cpu" or "cuda"

    QUICK: ClassVar[dict[str, Any]] = {"steps": 10, "warmup_steps": 2, "width": 128}

    def validate(self) -> None:
        self._positive("steps", "batch_size", "width")
        self._non_negative("warmup_steps", "prep_ms", "num_workers")
        self._device()


@dataclass
class ReportConfig(ExperimentConfig):
    """`diag report DIR`: re-render a run folder's figures and report.html from its CSVs."""

    folder: str = ""  # the run folder, e.g. runs/20261130T120000Z

    POSITIONAL: ClassVar[tuple[str, ...]] = ("folder",)

    def validate(self) -> None:
        if not self.folder:
            raise ValueError("ReportConfig.folder='': name a run folder (e.g. runs/<timestamp>)")


# -- storage (diag.storage) ----------------------------------------------------------------------

@dataclass
class StorageConfig(ExperimentConfig):
    """`diag storage`: object-store pull vs local disk read, the re-pull tax, land() miss/hit."""

    source: str = ""  # s3://bucket/key or s3://bucket/prefix/; "" = embedded S3 server + synthetic data
    endpoint_url: str = ""  # S3 endpoint; "" = the AWS chain (AWS_ENDPOINT_URL, profile) or embedded
    local_dir: str = ""  # where data lands (the NVMe / persistent volume); "" = DIAG_HOME/storage
    size_mb: float = 200.0  # embedded dataset size; larger gives steadier rates and takes longer
    shards: int = 1  # embedded dataset as this many objects under a prefix (1 = a single object)
    repeats: int = 3  # measured repeats per method; more gives steadier medians
    warmup: int = 1  # untimed first rounds (connections, server cache): not reported
    verify: str = "sha256"  # land() hit check: "sha256" catches flipped bytes, "size" is near-free
    retries: int = 4  # retries of a dropped connection (resumed by Range GET); 0 fails fast
    dataset_gb: float = 0.0  # dataset size for the tax; 0 = the measured size (e.g. 25 for yours)
    runs_per_week: float = 20.0  # training starts per week that re-pull the dataset
    usd_per_hour: float = 0.0  # instance price for the tax; 0 = unknown (no money figures)

    QUICK: ClassVar[dict[str, Any]] = {"size_mb": 8.0, "repeats": 2}

    def validate(self) -> None:
        self._positive("size_mb", "shards", "repeats")
        self._non_negative("warmup", "retries", "dataset_gb", "runs_per_week", "usd_per_hour")
        self._choice("verify", VERIFY_MODES)
        if self.source and not (self.source.startswith("s3://") and self.source[5:].split("/")[0]):
            raise ValueError(f"StorageConfig.source={self.source!r}: expected s3://bucket/key, "
                             "s3://bucket/prefix/ or '' for the embedded server")


# -- model load (diag.model_load) ----------------------------------------------------------------


@dataclass
class ModelLoadConfig(ExperimentConfig):
    """`diag model-load`: fresh vs cached model load, each part (download ... tokenizer) timed."""

    model: str = ""  # "" = the embedded tiny model on a local hub; "org/name" = HF_ENDPOINT or the real hub; a folder = no download
    revision: str = "main"  # branch, tag or commit of a hub model
    scenarios: list[str] = field(default_factory=lambda: list(MODEL_LOAD_SCENARIOS))  # fewer run faster; fresh downloads the whole model every repeat
    repeats: int = 3  # measured loads per scenario after one warm-up; more is steadier, each is a process start
    quantize: bool = True  # 4-bit nf4 (bitsandbytes) as QLoRA loads its base; False keeps the checkpoint dtype
    device: str = "auto"  # "auto", "cpu" or "cuda"
    cache_dir: str = ""  # HF hub cache of the cached scenarios; "" = <DIAG_HOME>/hf-cache, never your HF_HOME unless named
    repair_cache: bool = False  # True re-downloads cached files that fail their checksum; False stops and reports them
    trust_remote_code: bool = False  # True runs Python code from the model repo; only for repos you trust
    timeout_s: float = 1800.0  # per load process; a large model over a slow link needs more

    QUICK: ClassVar[dict[str, Any]] = {"repeats": 1}

    def validate(self) -> None:
        self._positive("repeats", "timeout_s")
        self._device()
        if isinstance(self.scenarios, str):
            self.scenarios = [s.strip() for s in self.scenarios.split(",") if s.strip()]
        if not self.scenarios or len(set(self.scenarios)) != len(self.scenarios):
            raise ValueError(f"ModelLoadConfig.scenarios={self.scenarios!r}: name each scenario "
                             "once: " + ", ".join(MODEL_LOAD_SCENARIOS))
        for s in self.scenarios:
            if s not in MODEL_LOAD_SCENARIOS:
                raise ValueError(f"ModelLoadConfig.scenarios: {s!r} is not a scenario; allowed "
                                 "values are " + ", ".join(map(repr, MODEL_LOAD_SCENARIOS)))
        if not self.revision:
            raise ValueError("ModelLoadConfig.revision='': name a branch, tag or commit (main)")


# -- loader (diag.loader) ------------------------------------------------------------------------
LOADER_PIPELINES = ("naive", "packed")  # tokenize per sample in the loop; or read the token cache
LOADER_CONSUMERS = ("emulated", "model")  # a step of fixed duration (DLIO style); the tiny model's
ON_ERROR = ("raise", "skip")  # what a reader does with a malformed row: stop, or leave out and list


@dataclass
class LoaderConfig(ExperimentConfig):
    """`diag workers`: DataLoader settings against a training step, the stall split, hot lines."""

    data: str = ""  # instruction JSONL; "" = the embedded synthetic dataset
    tokenizer: str = ""  # folder with tokenizer.json; "" = the embedded tiny model's
    pipelines: list[str] = field(default_factory=lambda: list(LOADER_PIPELINES))  # forms swept
    workers: list[int] = field(default_factory=lambda: [0, 1, 2, 4])  # num_workers swept; the first is the baseline the advice compares with
    batch_size: int = 16  # sequences per step (the seed user's 16 x 512 tokens)
    seq_len: int = 512  # tokens per sequence; longer means more tokenizing per sample
    consumer: str = "emulated"  # "emulated" waits step_ms per step (any GPU, on CPU); "model" trains the tiny model
    step_ms: float = 0.0  # emulated step; 0 = estimated for `gpu`, else the tiny model's step measured here
    gpu: str = ""  # estimate the step for this GPU (dense peak, 6 x params x tokens at `mfu`); "" = measure
    model_params_b: float = 1.1  # model size for the GPU estimate, billions of parameters
    mfu: float = 0.4  # model FLOPs utilization assumed by the GPU estimate; lower means a longer step
    steps: int = 20  # steady-state steps timed per setting, after the first batch and the prefetch; more is steadier
    repeats: int = 2  # epochs per setting on one DataLoader; persistent_workers keeps workers across them
    pin_memory: bool = True  # page-locked batches for a faster h2d copy (CUDA only)
    persistent_workers: bool = True  # keep workers across epochs instead of restarting them
    prefetch_factor: int = 2  # batches each worker prepares ahead; more absorbs jitter, costs memory
    extra_prep_ms: float = 0.0  # per-sample cost added to the pipeline: "what if preprocessing were heavier"
    target_share: float = 0.02  # data_wait share of the step the recommended setting stays under
    run_steps: int = 1000  # steps of the training run the advice prices its savings for
    profile_samples: int = 200  # samples run through the line profiler; more is steadier
    num_proc: int = 1  # processes tokenizing the token cache (measured: extra processes cost on 2 cores)
    on_error: str = "skip"  # malformed JSONL rows: "skip" counts and lists them, "raise" stops
    timeout_s: float = 120.0  # a batch not delivered in this time fails the setting (a hung worker)
    device: str = "auto"  # "auto", "cpu" or "cuda": where batches are copied and the model steps

    # quick: a given 20 ms step, so a test never waits on measuring the model's step first
    QUICK: ClassVar[dict[str, Any]] = {"workers": [0, 1, 2], "batch_size": 4, "seq_len": 128,
                                       "steps": 6, "repeats": 1, "profile_samples": 30,
                                       "step_ms": 20.0}

    def validate(self) -> None:
        self._positive("batch_size", "steps", "repeats", "prefetch_factor", "run_steps",
                       "profile_samples", "num_proc", "model_params_b", "mfu", "timeout_s",
                       "target_share")
        for name in ("batch_size", "steps", "repeats", "prefetch_factor", "run_steps",
                     "profile_samples", "num_proc"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"LoaderConfig.{name}={getattr(self, name)!r}: must be a whole "
                                 "number > 0")
        self._non_negative("step_ms", "extra_prep_ms")
        self._choice("consumer", LOADER_CONSUMERS)
        self._choice("on_error", ON_ERROR)
        self._device()
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"LoaderConfig.seq_len={self.seq_len!r}: must be a whole number >= 2")
        for name in ("mfu", "target_share"):
            if not getattr(self, name) < 1:
                raise ValueError(f"LoaderConfig.{name}={getattr(self, name)!r}: must be < 1")
        if isinstance(self.pipelines, str):
            self.pipelines = [p.strip() for p in self.pipelines.split(",") if p.strip()]
        if not self.pipelines or any(p not in LOADER_PIPELINES for p in self.pipelines):
            raise ValueError(f"LoaderConfig.pipelines={self.pipelines!r}: name one or more of "
                             + ", ".join(map(repr, LOADER_PIPELINES)))
        workers = self.workers
        if (not isinstance(workers, (list, tuple)) or not workers or len(set(workers)) != len(workers)
                or any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in workers)):
            raise ValueError(f"LoaderConfig.workers={workers!r}: must be a list of different "
                             "whole numbers >= 0 (num_workers values)")


# -- accum (diag.accum) --------------------------------------------------------------------------
# AccumConfig: the gradient-accumulation sweep at constant tokens per step, and MFU.


# -- qlora (diag.qlora) --------------------------------------------------------------------------
QLORA_PLANS = ("naive", "optimized", "both")


@dataclass
class QLoraConfig(ExperimentConfig):
    """`diag qlora`: the QLoRA fine-tune (nf4 base + LoRA, transformers.Trainer), naive vs optimized."""

    plan: str = "both"  # "naive" (a newcomer's defaults), "optimized" (the measured fixes) or both
    model: str = ""  # "" = the embedded tiny Llama on the local hub; "org/name" = HF_ENDPOINT / the hub
    source: str = ""  # dataset s3://bucket/key (JSONL); "" = the embedded S3 server + embedded dataset
    endpoint_url: str = ""  # S3 endpoint for source; "" = the AWS chain
    records: int = 128  # records both plans train on once (same tokens); demo-sized for a 2-core CPU
    steps: int = 8  # optimizer steps both plans take over those records (same LR schedule)
    seq_len: int = 128  # token slots per row: naive pads each record to it, optimized packs into it
    on_error: str = "raise"  # a bad row or a prompt filling seq_len: "raise" stops, "skip" counts it
    warmup_steps: int = 1  # first optimizer steps timed as `warmup`, apart from steady state
    lr: float = 2e-4  # peak learning rate (linear warm-up over 10% of steps, linear decay)
    seed: int = 0  # same seed in both plans, so the loss curves are comparable
    lora_r: int = 16  # LoRA rank; higher adapts more and trains slower
    lora_alpha: int = 32  # LoRA scale numerator (scale = alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input
    checkpoint_every: int = 0  # save adapter + optimizer + data position every N steps; 0 = at the end only
    resume: bool = False  # continue from the last checkpoint in out_dir, if there is one
    out_dir: str = ""  # checkpoints; "" = a fresh temporary folder per run
    device: str = "auto"  # "auto", "cpu" or "cuda"; CUDA-only settings on CPU fall back, with a note
    results: str = ""  # run folder whose experiment CSVs the optimized plan reads; "" = defaults

    QUICK: ClassVar[dict[str, Any]] = {"records": 12, "steps": 3, "seq_len": 96, "lora_r": 8,
                                       "lora_alpha": 16}

    def validate(self) -> None:
        self._choice("plan", QLORA_PLANS)
        self._choice("on_error", ON_ERROR)
        self._positive("records", "steps", "seq_len", "lr", "lora_r", "lora_alpha")
        self._non_negative("warmup_steps", "lora_dropout", "checkpoint_every", "seed")
        self._device()
        if not self.lora_dropout < 1:
            raise ValueError(f"QLoraConfig.lora_dropout={self.lora_dropout!r}: must be in [0, 1)")
        if self.steps > self.records:
            raise ValueError(f"QLoraConfig.steps={self.steps}: at most records={self.records} "
                             "(each optimizer step needs at least one record)")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"QLoraConfig.warmup_steps={self.warmup_steps}: must be below "
                             f"steps={self.steps}, so some steps are measured in steady state")
        if self.source and not (self.source.startswith("s3://") and self.source[5:].split("/")[0]):
            raise ValueError(f"QLoraConfig.source={self.source!r}: expected s3://bucket/key.jsonl "
                             "or '' for the embedded server")


# -- the whole diagnosis (diag.diagnose) ---------------------------------------------------------

@dataclass
class DiagnoseConfig(ExperimentConfig):
    """`diag run`: every experiment on one source, a naive and an optimized run, the report."""

    out: str = ""  # run folder to write; "" makes runs/<UTC timestamp>/
    source: str = ""  # dataset for the storage experiment (s3://...); "" = the embedded S3 server
    model: str = ""  # model for the model-load experiment (org/name or a folder); "" = embedded
    storage: bool = True  # run the storage experiment (object store vs local disk)
    model_load: bool = True  # run the model-load experiment (fresh vs cached)
    loader: bool = True  # run the data-loader experiment (num_workers sweep, stall split)
    steps: int = 60  # timed toy steps per run (naive and optimized)
    prep_ms: float = 3.0  # host preprocessing per batch: what num_workers has to hide
    qlora: bool = True  # naive vs optimized runs are the QLoRA job (diag.qlora); False = the toy loop
    naive_workers: int = 0  # DataLoader workers of the naive run (preprocessing in the loop)
    optimized_workers: int = 2  # DataLoader workers of the optimized run
    device: str = "auto"  # "auto", "cpu" or "cuda"
    current_gpu: str = ""  # GPU marked "now" on the Amdahl curve; "" = the detected one
    target_gpu: str = "H100 SXM"  # GPU you consider renting, marked at its dense-peak ratio
    quick_experiments: bool = False  # True runs each experiment in its test-sized variant (seconds)

    QUICK: ClassVar[dict[str, Any]] = {"steps": 12, "prep_ms": 2.0, "quick_experiments": True}

    def validate(self) -> None:
        self._positive("steps")
        self._non_negative("prep_ms", "naive_workers", "optimized_workers")
        self._device()


__all__ = [
    "ExperimentConfig",
    "DiagnoseConfig",
    "InfoConfig",
    "LoaderConfig",
    "ModelLoadConfig",
    "QLoraConfig",
    "ReportConfig",
    "StorageConfig",
    "ToyConfig",
    "diag_home",
    "quick_mode",
]
