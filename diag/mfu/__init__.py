"""MFU: FLOPs per token, the floor, and how close a training step came to the dense peak;
`formula` for any causal LM, `qlora` for what a QLoRA step executes, in its precisions."""
from diag.mfu.formula import (ModelShape, count_flops, disagreement, floor_impossible,
                              floor_seconds, judge_mfu, loss_of, mfu_from_figures, over_ranks)
from diag.mfu.qlora import (count_plans, count_step, plan_mfu, qlora_check, qlora_shape,
                            run_mfu, step_peak)

__all__ = ["ModelShape", "count_flops", "count_plans", "count_step", "disagreement",
           "floor_impossible", "floor_seconds", "judge_mfu", "loss_of", "mfu_from_figures",
           "over_ranks", "plan_mfu", "qlora_check", "qlora_shape", "run_mfu", "step_peak"]
