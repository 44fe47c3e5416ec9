"""The datasets a job trains from: `PackedDataset` (records binned into windows, position_ids
restarting per record so transformers keeps them apart), `NaiveTextDataset` (one padded record per
sample, tokenized in __getitem__, as a newcomer writes it) and nanoGPT's random windows of a flat
train.bin (`BatchLoader`: each batch gathered at once, the next prepared in a thread).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from diag.config import diag_home
from diag.data.records import read_source
from diag.data.text import IGNORE_INDEX, format_prompt, hf_tokenizer
from diag.data.tokens import build_token_cache
from diag.embedded import ensure_assets

PACK_CHUNK = 1000  # records binned together: more fill windows better, binning costs n log n


def check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: must be a whole number of tokens >= 2")


def best_fit_decreasing(lengths: np.ndarray, capacity: int, chunk: int = PACK_CHUNK
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds): window w holds order[bounds[w]:bounds[w + 1]]; longest first, per chunk."""
    order: list[int] = []
    sizes: list[int] = []
    for lo in range(0, len(lengths), chunk):
        part = np.asarray(lengths[lo:lo + chunk])
        bins: list[list[int]] = []
        room: list[tuple[int, int]] = []  # (tokens left, window), ascending
        for i in np.argsort(-part, kind="stable").tolist():
            n = int(part[i])
            k = bisect.bisect_left(room, (n, -1))  # the tightest window with room for it
            if k == len(room):
                bins.append([])
                left, b = capacity, len(bins) - 1
            else:
                left, b = room.pop(k)
            bins[b].append(lo + i)
            if left - n > 0:
                bisect.insort(room, (left - n, b))
        order += [i for b in bins for i in b]
        sizes += map(len, bins)
    return np.asarray(order, np.int64), np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])


def loss_counts(mask: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                block: int = 8192) -> np.ndarray:
    """Tokens with a loss in each record's first `lengths` tokens, less its first (unpredicted)."""
    out = np.zeros(len(starts), np.int64)
    for lo in range(0, len(starts), block):
        s, n = starts[lo:lo + block], lengths[lo:lo + block]
        if not len(s):
            continue
        base = int(s.min())
        span = np.concatenate([[0], np.cumsum(mask[base:int((s + n).max())], dtype=np.int64)])
        first = s - base + np.minimum(n, 1)
        out[lo:lo + block] = span[s - base + n] - span[first]
    return out


def packing_refused(attention: str | None) -> str:
    """Why packed records would see each other under this attention ("" where they cannot)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if (attention or "sdpa") in ALL_MASK_ATTENTION_FUNCTIONS:
        return ""
    return (f"attention {attention!r} gets no packed-sequence mask from transformers: records "
            "sharing a window would attend to each other, so each record has a window to itself")


class PackedDataset(Dataset):
    """seq_len windows of whole records (longer: cut, `left_out`); pack=False: a window each."""

    def __init__(self, cache_folder: str | os.PathLike[str], seq_len: int,
                 pad_token_id: int | None = None, records: Sequence[int] | None = None,
                 pack: bool = True) -> None:
        check_seq_len(seq_len)
        self.folder, self.seq_len = Path(cache_folder), seq_len
        meta = json.loads((self.folder / "meta.json").read_text())
        self.dtype = meta["dtype"]
        self.pad_token_id = int(meta["pad_token_id"] if pad_token_id is None else pad_token_id)
        offsets = np.load(self.folder / "offsets.npy", mmap_mode="r")
        picked = np.arange(len(offsets) - 1) if records is None \
            else np.asarray(records, dtype=np.int64)
        if picked.size and not 0 <= picked.min() <= picked.max() < len(offsets) - 1:
            raise IndexError(f"records: the cache holds {len(offsets) - 1} records")
        starts, ends = np.asarray(offsets[picked]), np.asarray(offsets[picked + 1])
        lengths = np.minimum(ends - starts, seq_len)
        self.tokens, self.left_out = int(lengths.sum()), int((ends - starts - lengths).sum())
        order, self._bounds = best_fit_decreasing(lengths, seq_len) if pack else \
            (np.arange(len(picked)), np.arange(len(picked) + 1))
        self._starts, self._lengths = starts[order], lengths[order]
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}  # a worker maps the files itself

    def _maps(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            self._arrays = (np.memmap(self.folder / "train.bin", dtype=self.dtype, mode="r"),
                            np.load(self.folder / "loss_mask.npy", mmap_mode="r"))
        return self._arrays

    def loss_tokens(self) -> int:
        """Tokens that carry a loss in the windows (response tokens and EOS, as kept)."""
        return int(loss_counts(self._maps()[1], self._starts, self._lengths).sum())

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, w: int) -> dict[str, torch.Tensor]:
        if not 0 <= w < len(self):
            raise IndexError(f"window {w} of {len(self)}")
        ids, mask = self._maps()
        input_ids = torch.full((self.seq_len,), self.pad_token_id, dtype=torch.int64)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)
        positions = torch.zeros(self.seq_len, dtype=torch.int64)
        at = 0
        for j in range(self._bounds[w], self._bounds[w + 1]):
            s, n = int(self._starts[j]), int(self._lengths[j])
            chunk = torch.from_numpy(np.asarray(ids[s:s + n], dtype=np.int64))
            input_ids[at:at + n] = chunk
            labels[at:at + n] = torch.where(torch.from_numpy(mask[s:s + n] == 1), chunk,
                                            IGNORE_INDEX)
            labels[at] = IGNORE_INDEX  # predicted by the record before it: no loss across
            positions[at:at + n] = torch.arange(n)
            at += n
        positions[at:] = torch.arange(self.seq_len - at)  # the padding: a sequence of its own
        return {"input_ids": input_ids, "labels": labels, "position_ids": positions}


class NaiveTextDataset(Dataset):
    """One record per item, tokenized in __getitem__ every epoch, padded (-100 but the response)."""

    def __init__(self, path_or_records: str | os.PathLike[str] | Sequence[dict[str, str]],
                 tokenizer_dir: str | os.PathLike[str], seq_len: int) -> None:
        check_seq_len(seq_len)
        if isinstance(path_or_records, (str, os.PathLike)):
            path_or_records, _ = read_source(path_or_records, on_error="raise")
        # a Sequence is kept as given: a dataset read item by item from disk stays there
        self.records = path_or_records if isinstance(path_or_records, Sequence) \
            else list(path_or_records)
        self.tokenizer_dir, self.seq_len = str(tokenizer_dir), seq_len
        if not Path(self.tokenizer_dir, "tokenizer.json").is_file():
            raise ValueError(f"tokenizer_dir={self.tokenizer_dir!r}: no tokenizer.json there")
        st = Path(self.tokenizer_dir, "tokenizer.json").stat()  # saved again: loaded again
        self.version = f"{st.st_size}-{st.st_mtime_ns}"

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokenizer = hf_tokenizer(self.tokenizer_dir, self.version)
        record = self.records[i]
        prompt, response = format_prompt(record, tokenizer)
        prompt_ids = tokenizer(prompt, add_special_tokens="messages" not in record)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id]
        ids = (prompt_ids + response_ids)[: self.seq_len]
        labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[: self.seq_len]
        pad = self.seq_len - len(ids)
        return {"input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "labels": torch.tensor(labels + [IGNORE_INDEX] * pad)}


@dataclass(frozen=True)
class TokenFile:
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
    if tokenizer_dir is None or dataset is None:
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


class BatchLoader(Iterator, contextlib.AbstractContextManager):  # their __iter__, __enter__
    """nanoGPT's get_batch: the map opened once, one gather per batch, pinned memory on CUDA."""

    def __init__(self, tokens: TokenFile, batch: int, seq_len: int, device: Any = "cpu",
                 seed: int = 0, prefetch: bool = True) -> None:
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

    __next__ = next

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __exit__(self, *exc: Any) -> None:
        self.close()
