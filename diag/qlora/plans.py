"""The two plans of the QLoRA job: the defaults a newcomer runs (`Plan.naive()`), and the
experiments' decisions collected (`Plan.optimized(decisions)`), each setting saying its why."""


from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from diag.decision import CHANGES, Decision, by_setting

# The settings a plan carries, each decided by one experiment (the owner of its default).
SETTINGS = ("fetch", "model_cache", "pipeline", "num_workers", "pin_memory",
            "persistent_workers", "prefetch_factor", "micro_batch", "gradient_checkpointing")


@dataclass(frozen=True)
class Plan:
    """Every setting of one QLoRA run; `decisions` says where each came from."""

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
    decisions: tuple[Decision, ...] = field(default_factory=tuple)  # one per setting
    notes: tuple[str, ...] = field(default_factory=tuple)  # device fallbacks, said out loud

    @classmethod
    def naive(cls) -> Plan:
        """A newcomer's first run: every default left as the libraries ship it."""
        why = "the default a first run gets"
        values = {"fetch": ("pull", f"{why}: the dataset copied from the object store per run"),
                  "model_cache": ("empty", f"{why}: a fresh container, an empty HF cache"),
                  "pipeline": ("naive", f"{why}: tokenize in __getitem__, pad to seq_len"),
                  "num_workers": (0, f"{why}: DataLoader num_workers=0"),
                  "pin_memory": (False, f"{why}: DataLoader pin_memory=False"),
                  "persistent_workers": (False, f"{why}: DataLoader persistent_workers=False"),
                  "prefetch_factor": (None, f"{why}: no workers, nothing prefetched"),
                  "micro_batch": (1, f"{why}: micro-batch 1, many accumulation steps"),
                  "gradient_checkpointing": (True, "prepare_model_for_kbit_training turns it on")}
        return cls.collect("naive", [Decision.default(k, v, w, source="naive")
                                     for k, (v, w) in values.items()])

    @classmethod
    def optimized(cls, decisions: Iterable[Decision] = (), device: str = "cpu") -> Plan:
        """The decisions; a setting none decided takes its owner's default for `device`."""
        from diag.accum import decide as accum
        from diag.loader import decide as loader
        from diag.model_load import decide as load
        from diag.qlora.checkpointing import decide as ckpt
        from diag.storage import decide as storage

        decisions = tuple(decisions)
        decided = {d.setting for d in decisions}
        if not decided >= set(SETTINGS):
            defaults = (*storage(None), *load(None), *loader(None), *accum(None),
                        *ckpt(None, device))
            decisions += tuple(d for d in defaults if d.setting not in decided)
        return cls.collect("optimized", decisions).for_device(device)

    @classmethod
    def collect(cls, name: str, decisions: Iterable[Decision]) -> Plan:
        """A plan whose every setting is its decision's value (one decision per setting)."""
        got = by_setting(decisions)
        if absent := [s for s in SETTINGS if s not in got]:
            raise ValueError(f"Plan {name!r}: no decision for {', '.join(absent)}")
        # persistent workers and prefetching need workers: with none the DataLoader refuses them
        off = {} if got["num_workers"].value else {"persistent_workers": False,
                                                   "prefetch_factor": None}
        kept = tuple(got[s].capped(off[s], "num_workers=0 (no worker to keep or prefetch)")
                     if s in off else got[s] for s in SETTINGS)
        return cls(name, **{d.setting: d.value for d in kept}, decisions=kept)

    def decision(self, setting: str) -> Decision:
        return by_setting(self.decisions)[setting]

    def _capped(self, setting: str, value: Any, why: str, note: str = "") -> Plan:
        decisions = tuple(d.capped(value, why) if d.setting == setting else d
                          for d in self.decisions)
        return dataclasses.replace(self, decisions=decisions, **{setting: value},
                                   notes=self.notes + ((note,) if note else ()))

    def for_device(self, device: str) -> Plan:
        """CUDA-only settings on a CPU: the CPU equivalent, and a note saying so (no crash)."""
        if str(device).startswith("cuda") or not self.pin_memory:
            return self
        note = ("pin_memory=True needs CUDA (page-locked memory for async host-to-device "
                "copies); on CPU the batch already is in host memory, so pin_memory=False is "
                "the equivalent")
        return self._capped("pin_memory", False, "no CUDA device", note)

    def fit(self, rows_per_step: int) -> Plan:
        """The micro-batch capped, out loud, to the largest divisor of the job's rows per step."""
        micro = fit_micro_batch(rows_per_step, self.micro_batch)
        return self._capped("micro_batch", micro, f"the job has {rows_per_step} rows per "
                            f"optimizer step; {micro} is the largest micro-batch <= "
                            f"{self.micro_batch} that divides them")

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("decisions", "notes")}

    def frame(self) -> Any:
        """One row per setting: run, setting, value, basis, evidence (what is shown and run)."""
        return pd.DataFrame([{"run": self.name, "setting": d.setting,
                              "value": str(getattr(self, d.setting)), "basis": d.basis,
                              "evidence": d.evidence()} for d in self.decisions])


def fixes(naive: Plan, optimized: Plan) -> dict[str, list[str]]:
    """Per run-level stage, the changes the optimized plan applied there ("micro_batch 1 -> 4")."""
    a, b = naive.settings(), optimized.settings()
    out: dict[str, list[str]] = {}
    for setting, stages in CHANGES.items():
        if a[setting] != b[setting]:
            for stage in stages:
                out.setdefault(stage, []).append(f"{setting} {a[setting]} -> {b[setting]}")
    return out


def fit_micro_batch(rows_per_step: int, micro: int) -> int:
    """The largest divisor of rows_per_step that is at most micro (at least 1)."""
    return max(d for d in range(1, max(1, min(micro, rows_per_step)) + 1) if rows_per_step % d == 0)
