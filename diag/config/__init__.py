"""One dataclass per experiment: literal defaults with a comment each, `quick()` for tests.

Every experiment takes its config as its only argument; the CLI builds `--key value` flags from
the same fields, so notebooks and the command line share one set of names and defaults. The
comment after each field is its `--help` text; a `Literal` type gives the flag its choices.
Build one with `XConfig.default(quick=None, **overrides)` (None: `DIAG_QUICK` decides).
"""

from diag.config.accum import ACCUM_DTYPES, ACCUM_MODELS, AccumConfig
from diag.config.base import (DEVICES, MODEL_LOAD_PROCESSES, MODEL_LOAD_SCENARIOS, STORAGE_PULLS,
                              VERIFY_MODES, ExperimentConfig, LoadProcess, Scenario, Verify,
                              diag_home, quick_mode)
from diag.config.general import DiagnoseConfig, InfoConfig, ReportConfig, ToyConfig, duration_s
from diag.config.loader import LOADER_CONSUMERS, LOADER_PIPELINES, ON_ERROR, LoaderConfig
from diag.config.model_load import ModelLoadConfig
from diag.config.observe import AttachConfig, TraceConfig
from diag.config.qlora import QLORA_PLANS, JobConfig, QLoraConfig
from diag.config.source import RecordFields, SourceConfig
from diag.config.storage import StorageConfig
from diag.config.train import TrainConfig

__all__ = [
    "ACCUM_DTYPES", "ACCUM_MODELS", "AccumConfig", "AttachConfig", "DEVICES", "DiagnoseConfig",
    "ExperimentConfig",
    "InfoConfig", "JobConfig", "LOADER_CONSUMERS", "LoadProcess", "MODEL_LOAD_PROCESSES",
    "LOADER_PIPELINES",
    "LoaderConfig", "MODEL_LOAD_SCENARIOS", "ModelLoadConfig", "ON_ERROR", "QLORA_PLANS",
    "QLoraConfig", "RecordFields", "ReportConfig", "STORAGE_PULLS", "Scenario", "SourceConfig",
    "StorageConfig", "ToyConfig", "TraceConfig", "TrainConfig", "VERIFY_MODES", "Verify",
    "diag_home",
    "duration_s", "quick_mode",
]
