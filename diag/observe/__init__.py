"""Jobs diag did not start: `attach(pid)` samples a running training process (py-spy, NVML,
/proc), `trace(*files)` reads the torch.profiler traces a job already wrote, one per rank. Both
give diag's stage table (a StageTimer frame) and through it amdahl's verdict, fixes and upgrade
projection; `RULES` is the table of frames that name the stages (docs/attach.md).
"""

from diag.observe.live import Attached, attach, run_attach
from diag.observe.rules import RULES, Rule, classify
from diag.observe.kineto import Traced, run_trace, trace

__all__ = ["Attached", "RULES", "Rule", "Traced", "attach", "classify", "run_attach",
           "run_trace", "trace"]
