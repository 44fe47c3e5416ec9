"""Jobs diag did not start: `attach(pid)` samples a running training process (py-spy, NVML,
/proc), `trace(*files)` reads the torch.profiler traces a job already wrote, one per rank. Both
give diag's stage table and through it amdahl's verdict, fixes and upgrade projection; `RULES`
is the table of frames that name the stages (docs/attach.md).
"""

from diag.observe.kineto import run_trace, trace
from diag.observe.live import attach, run_attach
from diag.observe.rules import RULES, classify

__all__ = ["RULES", "attach", "classify", "run_attach", "run_trace", "trace"]
