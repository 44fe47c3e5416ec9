"""The data layer under the experiments: records, the text pipeline, the one token cache.

`read_source(path, fields, on_error)` reads JSONL or Parquet (a file or a folder of shards) into
records; `NaiveTextDataset` tokenizes them per sample, `build_token_cache` once into
DIAG_HOME/tokens/<key>/ (data + tokenizer + settings), which `PackedDataset` (the loader sweep,
the QLoRA job) and `ensure_tokens` / `BatchLoader` (the accum sweep, nanoGPT's flat file) read.
"""

from diag.data.batches import BatchLoader, TokenFile, check_tokens, ensure_tokens, token_file
from diag.data.records import (DATA_SUFFIXES, PROBLEM_COLUMNS, read_source, render_chat,
                               shard_files)
from diag.data.text import (IGNORE_INDEX, PROMPT_TEMPLATE, NaiveTextDataset, PackedDataset,
                            encode_batch, format_prompt, load_tokenizer)
from diag.data.tokens import ARRAYS, TokenCache, build_token_cache, tokenize

__all__ = ["ARRAYS", "BatchLoader", "DATA_SUFFIXES", "IGNORE_INDEX", "NaiveTextDataset",
           "PROBLEM_COLUMNS", "PROMPT_TEMPLATE", "PackedDataset", "TokenCache", "TokenFile",
           "build_token_cache", "check_tokens", "encode_batch", "ensure_tokens", "format_prompt",
           "load_tokenizer", "read_source", "render_chat", "shard_files", "token_file", "tokenize"]
