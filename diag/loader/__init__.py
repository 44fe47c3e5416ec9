"""The data loader: does it keep up with the step, why not, and the smallest setting that does.

`run_loader(cfg)` sweeps DataLoader settings against an emulated (or real) training step and
gives the recommendation, the stall split (fetch vs prep) and the hot lines of the naive
preprocessing. The pipeline itself (`NaiveTextDataset`, `build_token_cache` + `PackedDataset`)
is what a training job imports to feed its model.
"""

from diag.loader.pipeline import (IGNORE_INDEX, PROMPT_TEMPLATE, NaiveTextDataset, PackedDataset,
                                  encode_batch, format_prompt, load_tokenizer, read_records)
from diag.loader.tokens import TokenCache, build_token_cache

__all__ = ["IGNORE_INDEX", "NaiveTextDataset", "PROMPT_TEMPLATE", "PackedDataset", "TokenCache",
           "build_token_cache", "encode_batch", "format_prompt", "load_tokenizer", "read_records"]
