"""One dataclass per experiment: literal defaults, `quick()` for tests, DIAG_QUICK for default().
The CLI's flags are the fields: a field's trailing comment is its --help, a Literal its choices."""
from diag.config.accum import ACCUM_MODELS, AccumConfig
from diag.config.base import (MODEL_LOAD_SCENARIOS, STORAGE_PULLS, VERIFY_MODES, ExperimentConfig,
                              diag_home, quick_mode)
from diag.config.general import (AttachConfig, DiagnoseConfig, InfoConfig, ReportConfig,
                                 ToyConfig, TraceConfig, duration_s)
from diag.config.loader import LoaderConfig
from diag.config.qlora import JobConfig, QLoraConfig, TrainConfig
from diag.config.source import ModelLoadConfig, SourceConfig, StorageConfig

__all__ = [
    "ACCUM_MODELS", "AccumConfig", "AttachConfig", "DiagnoseConfig", "ExperimentConfig",
    "InfoConfig", "JobConfig", "LoaderConfig", "MODEL_LOAD_SCENARIOS", "ModelLoadConfig",
    "QLoraConfig", "ReportConfig", "STORAGE_PULLS", "SourceConfig", "StorageConfig", "ToyConfig",
    "TraceConfig", "TrainConfig", "VERIFY_MODES", "diag_home", "duration_s", "quick_mode",
]
