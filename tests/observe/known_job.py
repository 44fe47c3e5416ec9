"""A training job with known stages for diag attach and diag trace to recover: diag's toy loop
(`diag toy`: a real DataLoader, prep_ms per batch, an MLP's step), its own StageTimer figures
written beside. `python known_job.py OUT.csv '{"steps": 400, ...}' [TRACE.json[.gz]]`: prints
"ready" once torch is imported (attach from then on), then trains; with TRACE, under
torch.profiler (CPU), exported there; under torchrun each rank writes OUT.csv's and TRACE's
rank-N variant. OUT.csv.waited holds the share of the run's wall the training thread waited for
a CPU while runnable (/proc/thread-self/schedstat): how much a busy box could move a stage."""

import json
import os
import sys
import time

import torch

from diag.config import ToyConfig
from diag.loader.toy import run_toy

out, cfg = sys.argv[1], ToyConfig(**json.loads(sys.argv[2]))
trace = sys.argv[3] if len(sys.argv) > 3 else ""
rank = os.environ.get("RANK")
if rank is not None:  # one file per rank: rank-0.json, rank-1.json
    trace = trace.replace("rank-N", f"rank-{rank}")
warm = torch.nn.Linear(2, 1)  # the first step's lazy imports (torch._dynamo) before "ready"
warm(torch.zeros(1, 2)).sum().backward()
torch.optim.AdamW(warm.parameters()).step()
print("ready", flush=True)


def run_delay_s() -> float:
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


delay0, start = run_delay_s(), time.perf_counter()
if trace:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        frame = run_toy(cfg)
    prof.export_chrome_trace(trace)
else:
    frame = run_toy(cfg)
if frame is not None and rank in (None, "0"):
    frame.to_csv(out, index=False)
    with open(out + ".waited", "w") as f:
        f.write(str((run_delay_s() - delay0) / (time.perf_counter() - start)))
sys.stdout.flush()
os._exit(0)  # no interpreter teardown: the job ends when its work does
