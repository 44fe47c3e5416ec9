"""The QLoRA fine-tune, naive vs optimized, proven side by side (`run_qlora`), and the whole
dataset trained under one plan, its adapter the output (`run_train`)."""

from diag.qlora.experiment import QLoraResult, run_qlora
from diag.qlora.plans import Plan
from diag.qlora.train import TrainResult, run_train

__all__ = ["Plan", "QLoraResult", "TrainResult", "run_qlora", "run_train"]
