"""nanoGPT-style batches: random seq_len windows of the token cache's (or a user's) train.bin,
each gathered at once, the next prepared in a thread (`BatchLoader`).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TokenFile:
    """A flat file of token ids and what made it."""

    path: Path  # train.bin: the ids of every document, each followed by the EOS id
    dtype: str  # "uint16" or "uint32" (numpy name), from the vocabulary size
    vocab_size: int  # ids are 0 .. vocab_size - 1 (0 when unknown: a user's file without meta)
    tokens: int  # ids in the file

    def open(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r")


def ensure_tokens(tokenizer_dir: str | os.PathLike[str] | None = None,
                  dataset: str | os.PathLike[str] | None = None,
                  home: str | os.PathLike[str] | None = None) -> TokenFile:
    """The dataset's token cache `train.bin`, built once (defaults: the embedded assets)."""
    from diag.config import diag_home
    from diag.data.tokens import build_token_cache

    if tokenizer_dir is None or dataset is None:
        from diag.embedded import ensure_assets

        assets = ensure_assets(home)
        tokenizer_dir = tokenizer_dir or assets.model_dir
        dataset = dataset or assets.dataset
    root = (Path(home) if home is not None else diag_home()) / "tokens"
    cache = build_token_cache(dataset, tokenizer_dir, cache_dir=root)
    return token_file(cache.folder / "train.bin")


def token_file(path: str | os.PathLike[str], dtype: str = "uint16") -> TokenFile:
    """A user's train.bin: its meta.json beside it when there is one, else nanoGPT's uint16."""
    path = Path(path)
    if (path.parent / "meta.json").is_file():  # names the folder's train.bin dtype, vocab, length
        meta = json.loads((path.parent / "meta.json").read_text())
        return TokenFile(path.parent / "train.bin", meta["dtype"], int(meta["vocab_size"]),
                         int(meta["tokens"]))
    if not path.is_file():
        raise ValueError(f"AccumConfig.token_file={str(path)!r}: no such file")
    size = np.dtype(dtype).itemsize
    if path.stat().st_size % size:
        raise ValueError(f"AccumConfig.token_file={str(path)!r}: {path.stat().st_size} bytes is "
                         f"not a whole number of {dtype} ids")
    return TokenFile(path, np.dtype(dtype).name, 0, path.stat().st_size // size)


def check_tokens(tokens: TokenFile, vocab_size: int, who: str = "the model") -> int:
    """The top id; ValueError naming the file, id and vocabulary when it is >= vocab_size."""
    data = tokens.open()
    if data.size < 2:
        raise ValueError(f"{tokens.path}: holds {data.size} token(s); a training window needs more")
    top = int(data.max())  # one pass over the map: ~1 ms per million ids
    for limit, name in ((vocab_size, who), (tokens.vocab_size, "the tokenizer that made it")):
        if limit and top >= limit:
            raise ValueError(f"{tokens.path}: holds token id {top}, but {name} has {limit} ids "
                             f"(0..{limit - 1}): the file was made with another tokenizer; "
                             "delete its folder to rebuild it, or name the matching model")
    return top


class BatchLoader:
    """nanoGPT's get_batch: the map opened once, one gather per batch, pinned memory on CUDA."""

    def __init__(self, tokens: TokenFile, batch: int, seq_len: int, device: Any = "cpu",
                 seed: int = 0, prefetch: bool = True) -> None:
        import torch

        self._data = tokens.open()  # kept open: pages stay mapped, no reopen per batch
        if self._data.size < seq_len + 2:
            raise ValueError(f"{tokens.path}: {self._data.size} tokens is too few for windows of "
                             f"seq_len={seq_len} (+1 for the targets)")
        self.batch, self.seq_len, self.device = batch, seq_len, torch.device(device)
        self._pin = self.device.type == "cuda"
        self._rng = np.random.default_rng(seed)  # used by the one worker thread only
        self._offsets = np.arange(seq_len + 1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="diag-batches") if prefetch else None
        self._next: Future | None = self._pool.submit(self._host_batch) if self._pool else None

    def _host_batch(self) -> torch.Tensor:
        import torch

        starts = self._rng.integers(0, self._data.size - self.seq_len - 1, size=self.batch)
        windows = self._data[starts[:, None] + self._offsets].astype(np.int64)  # one gather
        host = torch.from_numpy(windows)
        return host.pin_memory() if self._pin else host

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prepared batch on the device; the one after it starts preparing at once."""
        if self._pool is not None:
            host = self._next.result()  # type: ignore[union-attr]
            self._next = self._pool.submit(self._host_batch)  # immediately prefetch the next
        else:
            host = self._host_batch()
        # from pinned memory this copy is queued and returns at once: it overlaps the step
        both = host.to(self.device, non_blocking=self._pin)
        return both[:, :-1], both[:, 1:]

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
