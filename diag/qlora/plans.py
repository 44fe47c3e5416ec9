"""The two plans of the QLoRA job: what a newcomer runs, and what the measurements recommend.

`Plan.naive()` is the defaults a first run gets; `Plan.optimized(results)` derives each setting
from the experiments' frames (storage, model_load, loader, accum) and says in `evidence` which
measured row it rests on, or that the frame was absent and a documented default was taken.
`predictions(plan, results)` states, before the run, the seconds each fix should save.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from diag.timing import median_seconds

# Documented defaults when an experiment's frame is absent (each is said in the evidence).
DEFAULT_WORKERS = 2  # enough to overlap the pre-tokenized windows' reads with a step, given
#                     cores to spare: measured on 2 cores, 2 workers cost 1.4x per step against 0
#                     (they compete with the step's own threads), so default_workers() spares two
DEFAULT_MICRO_BATCH = 8  # a micro-batch that fits the tiny and the 1B model on any 16 GB GPU
DATA_WAIT_GOAL = 0.02  # the smallest loader setting under this share of the step wins
CHECKPOINTING_HEADROOM = 0.5  # recompute activations only when the measured peak exceeds this
#                               share of device memory (turning it off roughly doubles them)


@dataclass(frozen=True)
class Plan:
    """Every setting of one QLoRA run; `evidence` says where each came from."""

    name: str
    fetch: str  # "pull": boto3 defaults into a temp folder per run; "land": diag.storage.land once
    model_cache: str  # "empty": fresh download per run; "persistent": the HF cache kept across runs
    pipeline: str  # "naive": tokenize per sample, pad to seq_len; "packed": token cache, packed
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    micro_batch: int  # rows per forward pass; accumulation covers the rest of a step
    gradient_checkpointing: bool  # prepare_model_for_kbit_training's default is on
    evidence: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (setting, why)
    notes: tuple[str, ...] = field(default_factory=tuple)  # device fallbacks, said out loud
    decisions: tuple[Any, ...] = ()  # diag.decision.Decision per setting (the "plan" helper's)

    @classmethod
    def naive(cls) -> Plan:
        """A newcomer's first run: every default left as the libraries ship it."""
        why = "the default a first run gets"
        return cls("naive", fetch="pull", model_cache="empty", pipeline="naive", num_workers=0,
                   pin_memory=False, persistent_workers=False, prefetch_factor=None, micro_batch=1,
                   gradient_checkpointing=True,
                   evidence=(("fetch", f"{why}: the dataset copied from the object store per run"),
                             ("model_cache", f"{why}: a fresh container, an empty HF cache"),
                             ("pipeline", f"{why}: tokenize in __getitem__, pad to seq_len"),
                             ("num_workers", f"{why}: DataLoader num_workers=0"),
                             ("micro_batch", "micro-batch 1, many accumulation steps"),
                             ("gradient_checkpointing",
                              "prepare_model_for_kbit_training turns it on")))

    @classmethod
    def optimized(cls, results: dict[str, Any] | None = None, device: str = "cpu") -> Plan:
        """Settings from the measured frames in `results` (keys storage, model_load, loader,
        accum; a frame or an object with `.frame`); a missing frame gives the default, said so."""
        results = {k: _frame(v) for k, v in (results or {}).items()}
        ckpt_frame = results.get("checkpointing")
        evidence: list[tuple[str, str]] = []
        fetch = _choose_fetch(results.get("storage"), evidence)
        cache = _choose_cache(results.get("model_load"), evidence)
        loader = _choose_loader(results.get("loader"), evidence)
        micro, peak = _choose_micro(results.get("accum"), evidence)
        ckpt = _choose_checkpointing(peak, device, evidence, ckpt_frame)
        plan = cls("optimized", fetch=fetch, model_cache=cache, micro_batch=micro,
                   gradient_checkpointing=ckpt, evidence=tuple(evidence), **loader)
        return plan.for_device(device)

    def for_device(self, device: str) -> Plan:
        """CUDA-only settings on a CPU: the CPU equivalent, and a note saying so (no crash)."""
        if str(device).startswith("cuda") or not self.pin_memory:
            return self
        note = ("pin_memory=True needs CUDA (page-locked memory for async host-to-device "
                "copies); on CPU the batch already is in host memory, so pin_memory=False is "
                "the equivalent")
        return dataclasses.replace(self, pin_memory=False, notes=self.notes + (note,))

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("evidence", "notes", "decisions")}


def _frame(value: Any) -> Any:
    return getattr(value, "frame", value)


def _absent(frame: Any, *columns: str) -> bool:
    return frame is None or getattr(frame, "empty", True) or not set(columns) <= set(frame.columns)


def _choose_fetch(storage: Any, evidence: list) -> str:
    if _absent(storage, "method", "seconds"):
        evidence.append(("fetch", "storage frame absent: default land() once, reuse the copy"))
        return "land"
    pull, hit = median_seconds(storage, method="boto3_default"), median_seconds(storage, method="land",
                                                                   cache_state="hit")
    if pull is None or hit is None:
        evidence.append(("fetch", "storage frame lacks a boto3_default or land hit row: default "
                                  "land()"))
        return "land"
    choice = "land" if hit < pull else "pull"
    evidence.append(("fetch", f"measured: land() hit {hit:.3g} s vs boto3 default pull "
                              f"{pull:.3g} s per start -> {choice}"))
    return choice


def _choose_cache(model_load: Any, evidence: list) -> str:
    if _absent(model_load, "scenario", "part", "seconds"):
        evidence.append(("model_cache", "model_load frame absent: default persistent HF cache"))
        return "persistent"
    fresh = median_seconds(model_load, scenario="fresh", part="load_model")
    cached = median_seconds(model_load, scenario="cached", part="load_model")
    if fresh is None or cached is None:
        evidence.append(("model_cache", "model_load frame lacks fresh or cached: default "
                                        "persistent HF cache"))
        return "persistent"
    choice = "persistent" if cached < fresh else "empty"
    evidence.append(("model_cache", f"measured: cached load {cached:.3g} s vs fresh "
                                    f"{fresh:.3g} s -> {choice}"))
    return choice


def _choose_loader(loader: Any, evidence: list) -> dict[str, Any]:
    cols = ("num_workers", "pin_memory", "persistent_workers", "data_wait_share")
    if _absent(loader, *cols):
        workers = default_workers()
        evidence.append(("num_workers", f"loader frame absent: default {workers} workers "
                                        f"({DEFAULT_WORKERS}, two cores left to the step; "
                                        f"{_cores()} usable), pinned, persistent, packed "
                                        "token cache"))
        return {"pipeline": "packed", "num_workers": workers, "pin_memory": True,
                "persistent_workers": workers > 0, "prefetch_factor": 2 if workers else None}
    frame = loader
    pipeline = "packed"
    # real tokens/s, not samples/s: a packed row holds several records, a naive row one
    rate = "tokens_per_s" if "tokens_per_s" in frame.columns else "samples_per_s"
    if "pipeline" in frame.columns and rate in frame.columns:
        rates = frame.groupby("pipeline")[rate].median()
        fast = [p for p in rates.index if p != "naive"]
        if "naive" in rates.index and fast and rates["naive"] > rates[fast].max():
            pipeline = "naive"
        frame = frame[frame["pipeline"] != "naive"] if pipeline == "packed" and fast else frame
    by = ["num_workers", "pin_memory", "persistent_workers"]
    by += ["prefetch_factor"] if "prefetch_factor" in frame.columns else []
    table = frame.groupby(by, dropna=False)["data_wait_share"].median().reset_index()
    good = table[table["data_wait_share"] < DATA_WAIT_GOAL].sort_values("num_workers")
    row = (good if not good.empty else table.sort_values("data_wait_share")).iloc[0]
    rule = (f"the fewest workers under {DATA_WAIT_GOAL:.0%} data_wait" if not good.empty
            else f"none under {DATA_WAIT_GOAL:.0%}: the lowest data_wait")
    workers = int(row["num_workers"])
    prefetch = row.get("prefetch_factor")
    prefetch = None if workers == 0 or prefetch is None or _nan(prefetch) else int(prefetch)
    evidence.append(("num_workers", f"measured: {rule}: {workers} workers, data_wait "
                                    f"{row['data_wait_share']:.1%} of the step; {pipeline} "
                                    "pipeline"))
    return {"pipeline": pipeline, "num_workers": workers, "pin_memory": bool(row["pin_memory"]),
            "persistent_workers": bool(row["persistent_workers"]) and workers > 0,
            "prefetch_factor": prefetch}


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers() -> int:
    """DEFAULT_WORKERS where two cores stay free for the step's own threads, else fewer."""
    return max(0, min(DEFAULT_WORKERS, _cores() - 2))


def _nan(value: Any) -> bool:
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return value is None


def _choose_micro(accum: Any, evidence: list) -> tuple[int, float | None]:
    if _absent(accum, "micro_batch", "tokens_per_s"):
        evidence.append(("micro_batch", f"accum frame absent: default micro-batch "
                                        f"{DEFAULT_MICRO_BATCH}, fewest accumulation steps"))
        return DEFAULT_MICRO_BATCH, None
    ok = accum[accum["status"] == "ok"] if "status" in accum.columns else accum
    if ok.empty:
        evidence.append(("micro_batch", "accum frame has no point that ran: micro-batch 1"))
        return 1, None
    speed = ok.groupby("micro_batch")["tokens_per_s"].median()
    micro = int(speed.idxmax())
    peak = None
    if "peak_mem_gb" in ok.columns:
        peak = float(ok.loc[ok["micro_batch"] == micro, "peak_mem_gb"].max())
    evidence.append(("micro_batch", f"measured: micro-batch {micro} gave the most tokens/s "
                                    f"({speed.max():.4g}) of {len(speed)} points that ran"))
    return micro, peak


def _memory_gb(device: str) -> tuple[float, str]:
    """Memory the step's activations live in: the device's, or on CPU the host's available."""
    if str(device).startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory / 1e9
        return total, "device memory"
    with open("/proc/meminfo") as f:  # MemAvailable: what this process can still grow into
        info = {line.split(":")[0]: line.split()[1] for line in f}
    return int(info["MemAvailable"]) / 1e6, "available host memory"


def _checkpointing_cost(frame: Any) -> str:
    """What checkpointing cost per step in the measured frame (on vs off), '' if absent."""
    if _absent(frame, "gradient_checkpointing", "seconds"):
        return ""
    on = median_seconds(frame, gradient_checkpointing=True)
    off = median_seconds(frame, gradient_checkpointing=False)
    if on is None or off is None:
        return ""
    return f"; it costs {on / off:.3g}x per step here (on {on:.3g} s, off {off:.3g} s)"


def _choose_checkpointing(peak_gb: float | None, device: str, evidence: list,
                          frame: Any = None) -> bool:
    cost = _checkpointing_cost(frame)
    if peak_gb is None or _nan(peak_gb):
        on = str(device).startswith("cuda")  # on CPU activations only grow host RAM
        why = ("accum peak memory absent: on, the safe default" if on else
               "accum peak memory absent: off, on CPU activations live in host RAM")
        evidence.append(("gradient_checkpointing", why + cost))
        return on
    total, where = _memory_gb(device)
    on = peak_gb > CHECKPOINTING_HEADROOM * total
    evidence.append(("gradient_checkpointing", f"measured peak {peak_gb:.3g} GB of {total:.3g} "
                                               f"GB {where} -> {'on' if on else 'off'}{cost}"))
    return on
