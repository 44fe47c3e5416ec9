"""The data layer under the experiments: records, the text pipeline, the one token cache.

`read_source(path, fields, on_error)` reads JSONL or Parquet (a file or a folder of shards) into
records, chunk by chunk; `NaiveTextDataset` tokenizes them per sample, `build_token_cache` once,
streamed through a pool of processes, into DIAG_HOME/tokens/<key>/ (data + tokenizer +
settings), which `PackedDataset` (whole records per window, kept apart by position_ids: the
loader sweep, the QLoRA job) and `ensure_tokens` / `BatchLoader` (the accum sweep, nanoGPT's flat
file) read.
"""

from diag.data.batches import BatchLoader, TokenFile, check_tokens, ensure_tokens, token_file
from diag.data.packing import PackedDataset, best_fit_decreasing, loss_counts, packing_refused
from diag.data.records import DATA_SUFFIXES, PROBLEM_COLUMNS, read_source, shard_files
from diag.data.stream import ARRAYS
from diag.data.text import (IGNORE_INDEX, PROMPT_TEMPLATE, NaiveTextDataset, encode_pairs,
                            format_prompt, load_tokenizer)
from diag.data.tokens import TokenCache, build_token_cache, read_meta

__all__ = ["ARRAYS", "BatchLoader", "DATA_SUFFIXES", "IGNORE_INDEX", "NaiveTextDataset",
           "PROBLEM_COLUMNS", "PROMPT_TEMPLATE", "PackedDataset", "TokenCache", "TokenFile",
           "best_fit_decreasing", "build_token_cache", "check_tokens", "encode_pairs",
           "ensure_tokens", "format_prompt", "load_tokenizer", "loss_counts", "packing_refused",
           "read_meta", "read_source", "shard_files", "token_file"]
