"""The data loader: does it keep up with the step, why not, and the smallest setting that does.

`run_loader(cfg)` sweeps DataLoader settings against an emulated (or real) training step
(`sweep_workers`), recommends the smallest num_workers that keeps data_wait under 2% of the
step (`recommend`), splits the stall into fetch and prep (`stall_split`) and shows the hot lines
of the naive preprocessing (`profile_lines`). The pipeline itself (`NaiveTextDataset`, and
`build_token_cache` + `PackedDataset`) is what a training job imports to feed its model.
"""

from diag.loader.advice import advice, choose_workers, decide, recommend
from diag.loader.experiment import LoaderResult, run_loader
from diag.loader.pipeline import (IGNORE_INDEX, PROMPT_TEMPLATE, NaiveTextDataset, PackedDataset,
                                  encode_batch, format_prompt, load_tokenizer, read_records)
from diag.loader.profile import profile_lines
from diag.loader.stalls import stall_split
from diag.loader.steps import EmulatedStep, ModelStep, gpu_step_seconds
from diag.loader.sweep import Guarded, SampleError, Setting, measure_setting, sweep_workers
from diag.loader.tokens import TokenCache, build_token_cache

__all__ = ["EmulatedStep", "Guarded", "IGNORE_INDEX", "LoaderResult", "ModelStep",
           "NaiveTextDataset", "PROMPT_TEMPLATE", "PackedDataset", "SampleError", "Setting",
           "TokenCache", "advice", "build_token_cache", "choose_workers", "decide", "encode_batch",
           "format_prompt",
           "gpu_step_seconds", "load_tokenizer", "measure_setting", "profile_lines",
           "read_records", "recommend", "run_loader", "stall_split", "sweep_workers"]
