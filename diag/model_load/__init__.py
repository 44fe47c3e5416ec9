"""Fresh vs cached model load: what a job pays to get its base model onto the device.

`run_model_load(cfg)` loads the model in a clean process per scenario and repeat (fresh download,
cached, cached offline, cached with a cold page cache), forked from one process that paid the
imports once (`import`, reported: every job start pays it), every part timed (download, read,
quantize, to_device, tokenizer); `advice(frame)` says what a persistent cache, offline mode and a
warm page cache save per start. `verify_model_cache(cfg)` checks a cached copy by checksum.
"""

from diag.model_load.advice import SCENARIOS, advice, decide, medians
from diag.model_load.experiment import ModelLoadResult, run_model_load, verify_model_cache
from diag.model_load.hfcache import (ALLOW_PATTERNS, blob_files, problems, snapshot_folder,
                                     verify_cache, weight_files)
from diag.model_load.source import cache_dir_for, check_on_hub, not_in_user_cache, user_cache

__all__ = ["ALLOW_PATTERNS", "ModelLoadResult", "SCENARIOS", "advice", "blob_files",
           "cache_dir_for", "check_on_hub", "decide", "medians", "not_in_user_cache", "problems",
           "run_model_load", "snapshot_folder", "user_cache", "verify_cache", "verify_model_cache",
           "weight_files"]
