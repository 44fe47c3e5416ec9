"""The QLoRA fine-tune, naive vs optimized: the diagnosis's last step, proven side by side.

`run_qlora(cfg)` trains the same records with the same seed and schedule under `Plan.naive()`
(a newcomer's defaults) and `Plan.optimized(decisions)` (every fix the experiments measured) and
returns where each run's time went. (Time your own Trainer with `diag.TimingCallback`.)
"""

from diag.qlora.experiment import QLoraResult, run_qlora
from diag.qlora.plans import Plan
from diag.qlora.predict import savings

__all__ = ["Plan", "QLoraResult", "run_qlora", "savings"]
