"""diag: find what starves a GPU during LLM fine-tuning and pre-training, prove it, run the fix.

Experiments are functions `run_*(cfg)` returning frames, one noun each (`storage`, `model_load`,
`loader`, `accum`, `qlora`); `amdahl`, `plots` and `report` consume them (docs/architecture.md).
Heavy libraries are imported inside the functions that need them, so `import diag` is fast.
"""

import importlib
from typing import Any

from diag.timing import StageTimer

__version__ = "0.1.0"
__all__ = ["StageTimer", "TimingCallback", "__version__", "attach"]
# imported when first asked for, so `import diag` stays fast: a transformers TrainerCallback, and
# diag.attach(pid), a running job sampled
_LAZY = {"TimingCallback": "diag.timing.callback", "attach": "diag.observe"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diag' has no attribute {name!r}")
