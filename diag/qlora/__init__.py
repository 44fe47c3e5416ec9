"""The QLoRA fine-tune, naive vs optimized: the diagnosis's last step, proven side by side.

`run_qlora(cfg)` trains the same records with the same seed and schedule under `Plan.naive()` and
`Plan.optimized(decisions)` and returns where each run's time went, read from one cost table;
`run_train(cfg)` trains the whole dataset under one plan and leaves the adapter.
"""

from diag.qlora.experiment import QLoraResult, run_qlora
from diag.qlora.plans import Plan
from diag.qlora.train import TrainResult, run_train

__all__ = ["Plan", "QLoraResult", "TrainResult", "run_qlora", "run_train"]
