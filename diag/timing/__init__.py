"""The stage vocabulary, `StageTimer` and its comm_wait clock; `callback.TimingCallback` (it needs
transformers) times a Trainer; `distributed`: a rank's seat, `stragglers`: per-rank reading.
"""

from diag.timing.timer import (LOAD_PARTS, RUN_STAGES, STAGE_FRAME, STAGES, STEP_STAGES,
                               StageTimer, check_stage, is_stage_frame, median_seconds)

__all__ = ["LOAD_PARTS", "RUN_STAGES", "STAGES", "STAGE_FRAME", "STEP_STAGES", "StageTimer",
           "check_stage", "is_stage_frame", "median_seconds"]
