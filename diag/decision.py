"""Decisions: what an experiment concluded, carried to the plan as data.

One frozen `Decision` per setting: its value, basis, evidence rows, what was measured and what the
choice is worth; `frame` / `read` write and read decisions.csv. Thresholds and `FIXES` live here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:  # configs import the thresholds: no pandas on that path
    import pandas as pd

DATA_WAIT_GOAL = 0.02  # a loader setting keeps up when data_wait stays under this share of the step
DATA_WAIT_NEAR_BEST = 0.10  # no setting reaches the goal: the smallest within this share of the
DATA_WAIT_NEAR_BEST_S = 0.001  # best achievable data_wait (or this many seconds per step) wins
PREDICTION_TOLERANCE = 0.25  # |measured - predicted| above this share of predicted is flagged
PREDICTION_FLOOR_S = 0.05  # ... and a miss under this many seconds is never flagged
MFU_DISAGREEMENT = 0.10  # formula vs FlopCounterMode FLOPs further apart than this are flagged
CHECKPOINTING_HEADROOM = 0.5  # checkpointing stays on when the peak without it exceeds this share

ADVICE = ["stage", "finding", "seconds_saved", "evidence"]  # an experiment's advice: its fixes

# What to do about a stage (amdahl's findings) and what changing a Plan setting does, each once
_LAND = "land the dataset once on the training machine's disk and reuse it (diag.storage.land)"
_CACHE = "load the base from a persistent HF cache instead of downloading it"
_TOKENS = ("tokenize once into a token cache and serve packed windows "
           "(diag.data.build_token_cache + PackedDataset)")
FIXES = {
    "fetch_data": _LAND,
    "load_model": f"{_CACHE}, on local NVMe (HF_HOME), with HF_HUB_OFFLINE=1",
    "preprocess": "tokenize once and cache the result, or tokenize with several processes",
    "warmup": "the first steps' start-up (allocator, kernel selection, compile, the loader's "
              "first batches) is paid per start: fewer restarts or a cached compile cut it",
    "data_wait": "raise DataLoader num_workers, pin_memory=True, prefetch: the GPU waits on data",
    "h2d": "pin host memory and copy with non_blocking=True to overlap the copy with compute",
    "checkpoint": "checkpoint less often or asynchronously, to local disk first",
    "eval": "evaluate less often or on a smaller split",
    "comm_wait": "ranks wait at the gradient all-reduce for a late rank: fix the straggler's "
                 "stage (diag.timing.stragglers), or overlap more of it (DDP bucket_cap_mb)",
    "other": "look at per-step overhead outside data, copy and compute (logging, syncs)",
    "compute": "a faster GPU, or a higher MFU (larger micro-batch, fused kernels, bf16)",
    # Plan settings, in the order predict lists them
    "fetch": _LAND,
    "model_cache": _CACHE,
    "pipeline": _TOKENS,
    "num_workers": "DataLoader workers prepare the next batches during the step",
    "pin_memory": "page-locked host batches for async host-to-device copies",
    "persistent_workers": "workers started once, kept across epochs",
    "prefetch_factor": "batches each worker prepares ahead",
    "micro_batch": "larger micro-batch, fewer accumulation passes per step",
    "gradient_checkpointing": "activations kept, not recomputed in the backward pass",
}

# The stages each Plan setting changes (the waterfall names fixes by the run-level ones)
_WAIT, _WORK = ("warmup", "train", "data_wait"), ("warmup", "train", "compute")
CHANGES = {"fetch": ("fetch_data",), "model_cache": ("load_model",),
           "pipeline": ("preprocess", *_WORK, "data_wait"), "num_workers": _WAIT,
           "pin_memory": (*_WAIT, "h2d"), "persistent_workers": _WAIT, "prefetch_factor": _WAIT,
           "micro_batch": _WORK, "gradient_checkpointing": _WORK}

Basis = Literal["measured", "capped", "projected", "default"]
Setting = Literal["fetch", "model_cache", "pipeline", "num_workers", "pin_memory",
                  "persistent_workers", "prefetch_factor", "micro_batch", "gradient_checkpointing"]
BASES: tuple[str, ...] = get_args(Basis)


@dataclass(frozen=True)
class MeasuredOn:
    """What a decision's rows were measured on; empty fields are unknown or not applicable."""
    model: str = ""  # the model the step ran: "tiny (nf4 + LoRA)", "gpt2-small (bf16)"
    precision: str = ""  # "nf4", "bf16", "fp32"
    seq_len: int | None = None
    step: str = ""  # the step consumed: "the QLoRA step (measured)"
    device: str = ""  # "cpu", "cuda:0 (NVIDIA H200)"
    tokens_per_step: int | None = None  # token slots one timed optimizer step held

    def label(self) -> str:
        parts = [self.model, self.precision, self.seq_len and f"seq_len {self.seq_len}",
                 self.step, self.device]
        return ", ".join(str(p) for p in parts if p)


@dataclass(frozen=True)
class Decision:
    """One setting an experiment chose, with its evidence (never re-derived by a consumer)."""
    setting: Setting  # the Plan field it decides
    value: Any
    basis: Basis
    why: str  # one line with the figures it rests on: "2 workers: data_wait 0.8% of a 47 ms step"
    source: str = ""  # the experiment that decided: storage, model_load, loader, accum, ...
    measured_on: MeasuredOn = field(default_factory=MeasuredOn)
    rows: tuple[Mapping[str, Any], ...] = ()  # the measured rows it rests on, as records
    # worth: the naive value, seconds per `per` ("start"/"step") each costs in `stage`, on `clock`
    baseline: Any = None
    stage: str = ""
    per: str = ""
    baseline_s: float | None = None
    chosen_s: float | None = None
    naive_ratio: float | None = None  # naive step / chosen (checkpointing: on/off); None: untimed
    # how sure (diag.noise): chosen and rival sides' samples and spread; None: nothing compared
    samples: tuple[int, ...] = ()
    spread: tuple[float, ...] = ()
    resolved: bool | None = None
    tied: tuple[Any, ...] = ()
    repeats_s: float | None = None
    clock: str = ""

    def __post_init__(self) -> None:
        for name in ("samples", "spread", "tied"):  # as JSON gives them back: lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("baseline_s", "chosen_s", "naive_ratio", "repeats_s"):  # NaN: as None
            if _missing(getattr(self, name)):
                object.__setattr__(self, name, None)
        if self.setting not in get_args(Setting):
            raise ValueError(f"Decision.setting={self.setting!r}: allowed values are "
                             + ", ".join(get_args(Setting)))
        if self.basis not in BASES:
            raise ValueError(f"Decision.basis={self.basis!r}: allowed values are {BASES}")
        if self.basis != "default" and not self.rows:
            raise ValueError(f"Decision({self.setting!r}).rows: a {self.basis} decision names "
                             "the rows it rests on; use Decision.default(...) when there are none")

    @classmethod
    def default(cls, setting: str, value: Any, why: str, source: str = "") -> Decision:
        """No usable measurement: a documented default, and why."""
        return cls(setting, value, "default", why, source=source)

    @classmethod
    def from_rows(cls, setting: str, value: Any, why: str, rows: pd.DataFrame | Iterable[Mapping],
                  *, source: str, measured_on: MeasuredOn | None = None,
                  basis: Basis = "measured", **worth: Any) -> Decision:
        """A measured decision; `worth`: the fields from `baseline` on."""
        records = rows.to_dict("records") if hasattr(rows, "to_dict") else list(rows)
        # a figure a row lacks (NaN) is kept as None, as it reads back from decisions.csv
        records = [{k: None if _missing(v) else v for k, v in r.items()} for r in records]
        return cls(setting, value, basis, why, source=source,
                   measured_on=measured_on or MeasuredOn(), rows=tuple(records), **worth)

    def saving_s(self, count: float = 1.0) -> float | None:
        """Seconds the chosen value saves over the baseline, `count` times (starts or steps)."""
        if self.baseline_s is None or self.chosen_s is None:
            return None
        return (self.baseline_s - self.chosen_s) * count

    def capped(self, value: Any, why: str) -> Decision:
        """The same evidence, with the value limited by what the job can run (said in `why`)."""
        if value == self.value:
            return self
        basis: Basis = "default" if self.basis == "default" else "capped"
        return dataclasses.replace(self, value=value, basis=basis,
                                   why=f"{self.why}; capped to {value}: {why}")

    def evidence(self) -> str:
        """The one line a plan, a report and a notebook print for this setting."""
        on = self.measured_on.label()
        return f"{self.basis}{f' on {on}' if on else ''}: {self.why}"


COLUMNS = ["setting", "value", "basis", "source", "measured_on", "why",
           *(f.name for f in dataclasses.fields(MeasuredOn)), "rows", "baseline", "stage", "per",
           "baseline_s", "chosen_s", "naive_ratio", "clock", "json"]


def frame(decisions: Iterable[Decision]) -> pd.DataFrame:
    """One row per decision (COLUMNS), `json` the whole decision as `read` gives it back."""
    import pandas as pd

    rows = []
    for d in decisions:
        whole = dataclasses.asdict(d)
        rows.append({**whole, **whole["measured_on"], "measured_on": d.measured_on.label(),
                     "rows": len(d.rows), "json": json.dumps(whole, default=lambda v: v.item())})
    return pd.DataFrame(rows, columns=COLUMNS)


def read(table: pd.DataFrame) -> tuple[Decision, ...]:
    """The decisions a `frame` holds (a run folder's decisions.csv), equal to those written."""
    if "json" not in table.columns:
        raise ValueError("a decisions table without its json column: written by another diag "
                         "version; measure again")
    got = [json.loads(text) for text in table["json"]]
    return tuple(Decision(**d | {"measured_on": MeasuredOn(**d["measured_on"]),
                                 "rows": tuple(d["rows"])}) for d in got)


def _missing(value: Any) -> bool:
    return isinstance(value, float) and value != value


def decided(frames: Mapping[str, pd.DataFrame]) -> tuple[Decision, ...]:
    """The decisions in frames["decisions"] (a run folder's, a step's); () without one."""
    table = frames.get("decisions")
    return read(table) if table is not None else ()


def chosen(frames: Mapping[str, pd.DataFrame], setting: str) -> Decision | None:
    """The first decision of `setting` in frames["decisions"]."""
    return next((d for d in decided(frames) if d.setting == setting), None)


def by_setting(decisions: Iterable[Decision]) -> dict[str, Decision]:
    """Decisions keyed by setting; two experiments deciding one setting is a bug, said so."""
    out: dict[str, Decision] = {}
    for d in decisions:
        if d.setting in out:
            raise ValueError(f"two decisions for {d.setting!r}: {out[d.setting].source or '?'} "
                             f"and {d.source or '?'}; one experiment owns each setting")
        out[d.setting] = d
    return out
