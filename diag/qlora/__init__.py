"""The QLoRA fine-tune, naive vs optimized: the diagnosis's last step, proven side by side.

`run_qlora(cfg)` trains the same records with the same seed and schedule under `Plan.naive()`
(a newcomer's defaults) and `Plan.optimized(decisions)` (every fix the experiments measured) and
returns where each run's time went; `run_train(cfg)` then trains the whole dataset under one plan
and leaves the adapter. (Time your own Trainer with `diag.TimingCallback`.)
"""

from diag.qlora.experiment import QLoraResult, run_qlora
from diag.qlora.plans import Plan
from diag.qlora.predict import savings
from diag.qlora.train import TrainResult, run_train

__all__ = ["Plan", "QLoraResult", "TrainResult", "run_qlora", "run_train", "savings"]
