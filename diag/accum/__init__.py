"""Gradient accumulation at constant tokens per step: which micro-batch x grad_accum is fastest.

`run_accum(cfg)` trains each point on a real causal LM: tokens/s, seconds per step beside the
floor, memory, MFU, the decision; `train_points` / `retime` run any `AccumStep` (the QLoRA job's).
"""

from diag.accum.experiment import AccumResult, advice, decide, run_accum, summarize
from diag.accum.sweep import accum_frame, retime, train_points

__all__ = ["AccumResult", "accum_frame", "advice", "decide", "retime", "run_accum", "summarize",
           "train_points"]
