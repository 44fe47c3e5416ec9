"""The data loader: does it keep up with the step, why not, and the smallest setting that does.

`run_loader(cfg)` sweeps DataLoader settings against an emulated (or real) training step
(`sweep_workers`), recommends the smallest num_workers that keeps data_wait under 2% of the
step (`recommend`), splits the stall into fetch and prep (`stall_split`) and shows the hot lines
of the naive preprocessing (`profile_lines`). The pipelines it sweeps (`NaiveTextDataset`, and
`build_token_cache` + `PackedDataset`) live in diag.data, where a training job imports them.
"""

from diag.loader.advice import advice, choose_workers, decide, recommend
from diag.loader.experiment import LoaderResult, run_loader
from diag.loader.profile import profile_lines
from diag.loader.stalls import stall_split
from diag.loader.steps import EmulatedStep, ModelStep, gpu_step_seconds
from diag.loader.sweep import Guarded, SampleError, Setting, measure_setting, sweep_workers

__all__ = ["EmulatedStep", "Guarded", "LoaderResult", "ModelStep", "SampleError", "Setting",
           "advice", "choose_workers", "decide", "gpu_step_seconds", "measure_setting",
           "profile_lines", "recommend", "run_loader", "stall_split", "sweep_workers"]
