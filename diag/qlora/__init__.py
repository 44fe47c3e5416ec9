"""The QLoRA fine-tune, naive vs optimized: the diagnosis's last step, proven side by side.

`run_qlora(cfg)` trains the same records with the same seed and schedule under `Plan.naive()`
(a newcomer's defaults) and `Plan.optimized(results)` (every fix the experiments measured) and
returns where each run's time went; `TimingCallback` times any transformers Trainer's steps
(imported lazily: it needs transformers).
"""

from typing import Any

from diag.qlora.experiment import QLoraResult, load_results, run_qlora, savings
from diag.qlora.plans import Plan

__all__ = ["Plan", "QLoraResult", "TimingCallback", "load_results", "run_qlora", "savings"]


def __getattr__(name: str) -> Any:
    if name == "TimingCallback":  # transformers costs seconds to import: only when asked for
        from diag.qlora.callback import TimingCallback

        return TimingCallback
    raise AttributeError(f"module 'diag.qlora' has no attribute {name!r}")
