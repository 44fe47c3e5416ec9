"""The stage vocabulary and `StageTimer`; `TimingCallback` (lazily: it needs transformers) times a
Trainer; `distributed`: a rank's seat, `comm`: the comm_wait clock, `stragglers`: per-rank reading.
"""

from typing import Any

from diag.timing.timer import (LOAD_PARTS, RUN_STAGES, STAGE_FRAME, STAGES, STEP_STAGES,
                               StageTimer, check_stage, is_stage_frame, median_seconds)

__all__ = ["LOAD_PARTS", "RUN_STAGES", "STAGES", "STAGE_FRAME", "STEP_STAGES", "StageTimer",
           "TimingCallback", "check_stage", "is_stage_frame", "median_seconds"]


def __getattr__(name: str) -> Any:
    if name == "TimingCallback":  # transformers costs seconds to import: only when asked for
        from diag.timing.callback import TimingCallback

        return TimingCallback
    raise AttributeError(f"module 'diag.timing' has no attribute {name!r}")
