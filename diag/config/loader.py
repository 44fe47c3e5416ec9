"""`diag loader`: the data-loader experiment's config (diag.loader)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from diag.config.base import number, parse_list, whole
from diag.config.source import RecordFields
from diag.decision import DATA_WAIT_GOAL

LOADER_PIPELINES = ("naive", "packed")  # tokenize per sample in the loop; read the token cache


@dataclass
class LoaderConfig(RecordFields):
    """`diag loader`: DataLoader num_workers sweep against a training step, fetch vs prep stalls,
    the hot lines of the naive preprocessing."""

    data: str = ""  # your records: a JSONL or Parquet file or a folder of shards; "" = embedded
    tokenizer: str = ""  # folder with tokenizer.json (and chat template); "" = the embedded one
    pipelines: list[str] = field(default_factory=lambda: list(LOADER_PIPELINES))  # forms swept
    workers: list[int] = field(default_factory=lambda: [0, 1, 2, 4])  # num_workers; 1st: baseline
    batch_size: int = 16  # sequences per step
    seq_len: int = 512  # tokens per sequence; longer means more tokenizing per sample
    consumer: Literal["emulated", "model"] = "emulated"  # a step_ms wait (DLIO); the tiny model
    step_ms: float = 0.0  # emulated step; 0 = estimated for `gpu`, else the tiny model's measured
    gpu: str = ""  # estimate the step for this GPU (6 x params x tokens at `mfu`); "" = measure
    model_params_b: float = 1.1  # model size for the GPU estimate, billions of parameters
    mfu: float = 0.4  # model FLOPs utilization the GPU estimate assumes; lower: a longer step
    steps: int = 8  # steady steps timed per setting, after the prefetch; more is steadier
    repeats: int = 5  # epochs per setting: the decision's samples (5: the fewest that resolve)
    pin_memory: bool = True  # page-locked batches for a faster h2d copy (CUDA only)
    persistent_workers: bool = True  # keep workers across epochs instead of restarting them
    prefetch_factor: int = 2  # batches each worker prepares ahead; more absorbs jitter, costs RAM
    extra_prep_ms: float = 0.0  # per-sample cost added: "what if preprocessing were heavier"
    target_share: float = DATA_WAIT_GOAL  # data_wait share the recommended setting stays under
    run_steps: int = 1000  # steps of the training run the advice prices its savings for
    profile_samples: int = 200  # samples run through the line profiler; more is steadier
    num_proc: int = 1  # processes tokenizing the token cache
    on_error: str = "skip"  # malformed JSONL rows: "skip" counts and lists them, "raise" stops
    timeout_s: float = 120.0  # a batch not delivered in this time fails the setting (hung worker)
    device: str = "auto"  # "auto", "cpu" or "cuda": where batches are copied and the model steps

    # a given 20 ms step: a test never waits on measuring the model's step
    QUICK: ClassVar[dict[str, Any]] = {"workers": [0, 1, 2], "batch_size": 4, "seq_len": 128,
                                       "steps": 6, "repeats": 1, "profile_samples": 30,
                                       "step_ms": 20.0}
    # `diag run --no-qlora`: five samples a setting against the target GPU's step
    RUN: ClassVar[dict[str, Any]] = {"steps": 2, "repeats": 5}

    def validate(self) -> None:
        super().validate()  # the record fields
        if self.fields() and not self.data:  # the embedded records are never renamed
            name = next(k for k, v in self.source_kwargs().items() if v)
            raise ValueError(f"LoaderConfig.{name}={getattr(self, name)!r}: names a field of "
                             "--data's records, and --data is empty; give --data (your records)")
        self._whole("batch_size", "steps", "repeats", "prefetch_factor", "run_steps",
                    "profile_samples", "num_proc")
        self._whole("seq_len", low=2)
        self._positive("model_params_b", "timeout_s")
        self._check(("mfu", "target_share"), lambda v: number(v) and 0 < v < 1,
                    "must be a number in (0, 1)")
        self._non_negative("step_ms", "extra_prep_ms")
        self.pipelines = parse_list(self.pipelines)
        self._check(("pipelines",), lambda v: v and set(v) <= set(LOADER_PIPELINES),
                    "name one or more of " + ", ".join(map(repr, LOADER_PIPELINES)))
        self._check(("workers",), lambda v: isinstance(v, (list, tuple)) and v and len(set(
            v)) == len(v) and all(whole(w) and w >= 0 for w in v), "must be a list of different "
            "whole numbers >= 0 (num_workers values)")
