"""Fresh vs cached model load: what a job pays to get its base model onto the device.
`run_model_load(cfg)` times each part of a load in a clean process per scenario and repeat;
`medians(frame)` is the table to read, `advice(frame)` what a cache, offline mode, a warm page
cache save per start."""

from diag.model_load.experiment import (SCENARIOS, ModelLoadResult, advice, decide, medians,
                                        run_model_load, verify_model_cache)
from diag.model_load.source import (ALLOW_PATTERNS, cache_dir_for, check_on_hub, not_in_user_cache,
                                    snapshot_folder, user_cache, weight_files)

__all__ = ["ALLOW_PATTERNS", "ModelLoadResult", "SCENARIOS", "advice", "cache_dir_for",
           "check_on_hub", "decide", "medians", "not_in_user_cache", "run_model_load",
           "snapshot_folder", "user_cache", "verify_model_cache", "weight_files"]
