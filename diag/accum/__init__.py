"""Gradient accumulation at constant tokens per step: which micro-batch x grad_accum is fastest
(`run_accum`), and the harness that times any `AccumStep` (`train_points`, `retime`)."""
from diag.accum.experiment import AccumResult, advice, decide, run_accum, summarize
from diag.accum.sweep import accum_frame, retime, train_points

__all__ = ["AccumResult", "accum_frame", "advice", "decide", "retime", "run_accum", "summarize",
           "train_points"]
