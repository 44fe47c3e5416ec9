"""The datasets a job trains from: `PackedDataset` (records binned into windows, position_ids
restarting per record so transformers keeps them apart) or `NaiveTextDataset` (one padded record
per sample, tokenized in __getitem__, as a newcomer writes it).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from diag.data.text import IGNORE_INDEX, format_prompt, hf_tokenizer

PACK_CHUNK = 1000  # records binned together: more fill windows better, binning costs n log n


def check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r}: must be a whole number of tokens >= 2")


def best_fit_decreasing(lengths: np.ndarray, capacity: int, chunk: int = PACK_CHUNK
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(order, bounds): window w holds records order[bounds[w]:bounds[w + 1]]; per chunk (as TRL
    bins per map batch), longest first, each into the fullest window it fits."""
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
        for b in bins:
            order += b
            sizes.append(len(b))
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
    """Windows of seq_len tokens holding whole records (a longer one cut: `left_out`), labels -100
    on prompts, each record's first token and padding; pack=False: a window each."""

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
            from diag.data.records import read_source

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
        input_ids = torch.tensor(ids + [tokenizer.pad_token_id] * pad)
        attention_mask = torch.tensor([1] * len(ids) + [0] * pad)
        labels = torch.tensor(labels + [IGNORE_INDEX] * pad)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
