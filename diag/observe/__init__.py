"""Jobs diag did not start: `attach(pid)` samples a running training process (py-spy, NVML, /proc),
`trace(*files)` reads its torch.profiler traces (one per rank); both give the stage table, amdahl's
verdict, fixes and upgrade projection. `RULES` names the stages by frame (docs/attach.md).
"""

from diag.observe.kineto import run_trace, trace
from diag.observe.live import RULES, attach, classify, run_attach

__all__ = ["RULES", "attach", "classify", "run_attach", "run_trace", "trace"]
