"""Timing: the stage vocabulary and StageTimer, the Trainer callback, the distributed seat.

`StageTimer` (timer.py) records intervals in the stage vocabulary; `TimingCallback` (callback.py,
imported lazily: it needs transformers) times any transformers Trainer with it, `TimedStep`
(harness.py) the accum harness's step; distributed.py is a rank's seat under torchrun /
accelerate (joining, its timeouts, the one gather to rank 0); comm.py clocks comm_wait on a DDP
model (its buffer broadcast, its all-reduce through a hook that only times); spill.py the rows a
rank writes as it goes; stragglers.py reads the per-rank frames like amdahl reads one run's.
"""

from typing import Any

from diag.timing.timer import (LOAD_PARTS, RUN_STAGES, STAGE_COLUMNS, STAGE_FRAME, STAGES,
                               STEP_STAGES, StageTimer, check_stage, is_stage_frame,
                               median_seconds)

__all__ = ["LOAD_PARTS", "RUN_STAGES", "STAGES", "STAGE_COLUMNS", "STAGE_FRAME", "STEP_STAGES",
           "StageTimer", "TimingCallback", "check_stage", "is_stage_frame", "median_seconds"]


def __getattr__(name: str) -> Any:
    if name == "TimingCallback":  # transformers costs seconds to import: only when asked for
        from diag.timing.callback import TimingCallback

        return TimingCallback
    raise AttributeError(f"module 'diag.timing' has no attribute {name!r}")
