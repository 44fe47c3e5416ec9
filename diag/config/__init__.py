"""One dataclass per experiment: literal defaults with a comment each, `quick()` for tests.

The CLI builds `--key value` flags from the same fields: each field's trailing comment is its
`--help`, a `Literal` its choices. `XConfig.default(quick=None, **overrides)`: DIAG_QUICK decides.
"""

from diag.config.accum import ACCUM_MODELS, AccumConfig
from diag.config.base import (MODEL_LOAD_PROCESSES, MODEL_LOAD_SCENARIOS, STORAGE_PULLS,
                              VERIFY_MODES, ExperimentConfig, diag_home, quick_mode)
from diag.config.general import DiagnoseConfig, InfoConfig, ReportConfig, ToyConfig, duration_s
from diag.config.loader import ON_ERROR, LoaderConfig
from diag.config.model_load import ModelLoadConfig
from diag.config.observe import AttachConfig, TraceConfig
from diag.config.qlora import JobConfig, QLoraConfig
from diag.config.source import RecordFields, SourceConfig
from diag.config.storage import StorageConfig
from diag.config.train import TrainConfig

__all__ = [
    "ACCUM_MODELS", "AccumConfig", "AttachConfig", "DiagnoseConfig", "ExperimentConfig",
    "InfoConfig", "JobConfig", "LoaderConfig", "MODEL_LOAD_PROCESSES", "MODEL_LOAD_SCENARIOS",
    "ModelLoadConfig", "ON_ERROR", "QLoraConfig", "RecordFields", "ReportConfig", "STORAGE_PULLS",
    "SourceConfig", "StorageConfig", "ToyConfig", "TraceConfig", "TrainConfig", "VERIFY_MODES",
    "diag_home", "duration_s", "quick_mode",
]
