"""`diag model-load`: the model-load experiment's config (diag.model_load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from diag.config.base import MODEL_LOAD_SCENARIOS, LoadProcess, Scenario
from diag.config.source import MODEL, SourceConfig


@dataclass
class ModelLoadConfig(SourceConfig):
    """`diag model-load`: fresh vs cached model load, each part (download ... tokenizer) timed."""

    SOURCE: ClassVar[tuple[str, ...]] = MODEL  # the model's flags; no bucket, no records

    scenarios: list[Scenario] = field(  # fewer run faster; fresh downloads the model every repeat
        default_factory=lambda: list(MODEL_LOAD_SCENARIOS))
    repeats: int = 1  # measured loads per scenario after the warm-up; 5+ lets model_cache resolve
    budget_s: float = 0.0  # > 0: more repeats while model_cache is unresolved and they fit
    estimate_fresh: bool = False  # True: a cached model's fresh load is estimated from one
                                  # file's download rate, not downloaded whole
    warmup: int = 1  # untimed loads first (the page cache of the model and libraries)
    quantize: bool = True  # 4-bit nf4 as QLoRA loads its base; False keeps the checkpoint dtype
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:N"
    process: LoadProcess = "fork"  # "fork": imports paid once, a forked child per load;
                                   # "exec": a fresh interpreter per load (slower, same figures)
    trust_remote_code: bool = False  # True runs Python code from the model repo: only one you trust
    timeout_s: float = 1800.0  # per load process; a large model over a slow link needs more

    QUICK: ClassVar[dict[str, Any]] = {"repeats": 1}

    def validate(self) -> None:
        super().validate()  # the source flags
        self._positive("repeats", "timeout_s")
        self._non_negative("warmup", "budget_s")
        if isinstance(self.scenarios, str):
            self.scenarios = [s.strip() for s in self.scenarios.split(",") if s.strip()]
        self._check(("scenarios",), lambda v: v and len(set(v)) == len(v), "name each scenario "
                    "once: " + ", ".join(MODEL_LOAD_SCENARIOS))
        for s in self.scenarios:
            if s not in MODEL_LOAD_SCENARIOS:
                raise ValueError(f"ModelLoadConfig.scenarios: {s!r} is not a scenario; allowed "
                                 "values are " + ", ".join(map(repr, MODEL_LOAD_SCENARIOS)))
