"""The data layer: records (`read_source`), the text pipeline, the one token cache
(`build_token_cache`) and its readers (`PackedDataset`, `BatchLoader`); only datasets import torch.
"""

from typing import Any

from diag.data.records import count_records, read_source, shard_files
from diag.data.stream import ARRAYS
from diag.data.text import IGNORE_INDEX, encode_pairs, format_prompt, hf_tokenizer, load_tokenizer
from diag.data.tokens import TokenCache, build_token_cache, read_meta

# diag.data.packing's names, imported when first asked for (it imports torch)
_TORCH = ("BatchLoader", "NaiveTextDataset", "PackedDataset", "best_fit_decreasing", "check_tokens",
          "ensure_tokens", "loss_counts", "packing_refused", "token_file")


def __getattr__(name: str) -> Any:
    if name in _TORCH:
        from diag.data import packing

        return getattr(packing, name)
    raise AttributeError(f"module 'diag.data' has no attribute {name!r}")


__all__ = ["ARRAYS", "IGNORE_INDEX", "TokenCache", "build_token_cache", "count_records",
           "encode_pairs", "format_prompt", "hf_tokenizer", "load_tokenizer", "read_meta",
           "read_source", "shard_files", *_TORCH]
