"""Gradient accumulation at constant tokens per step, with an MFU that can be trusted.

`run_accum(cfg)` sweeps micro_batch x grad_accum at the same tokens per optimizer step on a real
causal LM (`sweep_grad_accum`), reports tokens/s, seconds per step beside the floor (the step at
100% of the dense peak), memory, MFU cross-checked with FlopCounterMode, and the advice.
`train_points` is the one sweep harness: any `AccumStep` (this model's, the QLoRA job's);
`retime` re-times the points a decision cannot yet tell apart; `step_clock` names the clock a
decision compares steps on (CPU seconds on a CPU, wall on a GPU).
`mfu_from_figures()` checks your own run's MFU; its data is diag.data's `ensure_tokens` /
`BatchLoader` (the token cache's flat file).
"""

from diag.accum.experiment import AccumResult, advice, decide, mfu_check, run_accum, summarize
from diag.accum.mfu import (NANOGPT_PEAK, ModelShape, count_flops, disagreement, floor_seconds,
                            judge_mfu, mfu_from_figures)
from diag.accum.model import Setup, measure, sweep_grad_accum
from diag.accum.sweep import (COLUMNS, AccumStep, PeakMemory, accum_frame, is_oom, pairs,
                              retime, samples, train_points)

__all__ = ["AccumResult", "AccumStep", "COLUMNS", "ModelShape", "NANOGPT_PEAK", "PeakMemory",
           "Setup", "accum_frame", "advice", "count_flops", "decide", "disagreement",
           "floor_seconds", "is_oom", "judge_mfu", "measure", "mfu_check", "mfu_from_figures",
           "pairs", "retime", "run_accum", "samples", "summarize",
           "sweep_grad_accum", "train_points"]
