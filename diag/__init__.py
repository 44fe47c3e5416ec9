"""diag: find what starves a GPU during LLM fine-tuning and pre-training, prove it, run the fix.

Experiments are functions `run_*(cfg)` that return a DataFrame (or a small dataclass of frames),
one noun each: `storage`, `model_load`, `loader`, `accum`, `qlora`; `amdahl`, `plots` and `report`
consume their frames (docs/architecture.md). Heavy libraries (torch, transformers, boto3) are
imported inside the functions that need them, so `import diag` is fast.
"""

from typing import Any

from diag.timing import StageTimer

__version__ = "0.1.0"
__all__ = ["StageTimer", "TimingCallback", "__version__", "attach"]


def __getattr__(name: str) -> Any:
    # diag.TimingCallback: a transformers TrainerCallback, so transformers is imported only
    # when it is asked for and `import diag` stays fast
    if name == "TimingCallback":
        from diag.timing.callback import TimingCallback

        return TimingCallback
    if name == "attach":  # diag.attach(pid): a running job, sampled (diag.observe)
        from diag.observe import attach

        return attach
    raise AttributeError(f"module 'diag' has no attribute {name!r}")
