"""Gradient accumulation at constant tokens per step: which micro-batch x grad_accum is fastest.

`run_accum(cfg)` trains each point of the sweep on a real causal LM and reports tokens/s, seconds
per step beside the floor (100% of the dense peak, diag.mfu), memory, MFU and the advice.
`train_points` / `retime` are the sweep harness any `AccumStep` runs on (the QLoRA job's too).
"""

from diag.accum.experiment import AccumResult, advice, decide, run_accum, summarize
from diag.accum.sweep import accum_frame, retime, train_points

__all__ = ["AccumResult", "accum_frame", "advice", "decide", "retime", "run_accum", "summarize",
           "train_points"]
