"""The QLoRA job's data, from diag.data's pipeline: the same records for both plans.

`job_records` takes the source's first records from the one token cache (a prefix of the
source: the folder the loader and accum sweeps read when they cover it), drops (or refuses)
those whose prompt leaves no response token inside seq_len and counts them from the cache's
offsets and loss mask; `build_dataset` makes the plan's Dataset (per-sample tokenized and padded,
or whole records packed into windows and kept apart by position_ids) and splits each optimizer
step into micro-batch x accumulation so both plans take the same steps over the same records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diag.config import QLoraConfig
    from diag.data import TokenCache
    from diag.qlora.plans import Plan


@dataclass(frozen=True)
class Records:
    """The records both plans train on, as the token cache holds them."""

    cache: TokenCache  # holding at least the source's first cfg.records good records
    indices: list[int]  # each record's place among the source's good records (the cache's)
    lengths: list[int]  # tokens per record (BOS + prompt + response + EOS), before seq_len cuts
    loss: list[int]  # tokens carrying a loss in its first seq_len (diag.data.loss_counts)
    skipped: int  # records left out: prompt too long for seq_len, or a malformed line


@dataclass(frozen=True)
class Data:
    dataset: Any  # a torch Dataset of {"input_ids", "labels", ...} rows
    micro_batch: int
    grad_accum: int
    stats: dict[str, Any]  # rows, token_slots, real_tokens, loss_tokens, padding_share, ...


def read(cfg: QLoraConfig, path: Path) -> list[dict[str, str]]:
    """The first cfg.records good records of the data at path (a JSONL or Parquet file, or a
    folder of shards: diag.data), read with cfg's fields: the naive plan's own read."""
    from diag.data import read_source

    return read_source(path, cfg.fields(), on_error=cfg.on_error, limit=cfg.records)[0]


def _cache(cfg: QLoraConfig, source: Path, tokenizer_dir: Path) -> TokenCache:
    from diag.data import build_token_cache

    return build_token_cache(source, tokenizer_dir, fields=cfg.fields(), on_error=cfg.on_error,
                             limit=cfg.records)


def job_records(cfg: QLoraConfig, source: Path, tokenizer_dir: Path) -> Records:
    """The first cfg.records good records of the data at source, counted from the token cache
    (built here once; nothing is encoded twice). Records whose prompt fills seq_len train on
    nothing (every label -100): refused with on_error="raise", counted and left out with
    "skip"; then whole steps: the same number of records in each of cfg.steps."""
    import numpy as np

    from diag.data import loss_counts

    cache = _cache(cfg, source, tokenizer_dir)
    n = min(cfg.records, cache.records)
    offsets = np.load(cache.folder / "offsets.npy", mmap_mode="r")
    starts, lengths = np.asarray(offsets[:n]), np.diff(offsets[:n + 1])
    mask = np.load(cache.folder / "loss_mask.npy", mmap_mode="r")
    loss = loss_counts(mask, starts, np.minimum(lengths, cfg.seq_len))
    empty = np.flatnonzero(loss == 0)
    if empty.size and cfg.on_error == "raise":
        raise ValueError(f"record {empty[0]}: its prompt fills QLoraConfig.seq_len={cfg.seq_len} "
                         "and leaves no response token to train on; raise seq_len, or pass "
                         "on_error='skip' to leave such records out (counted)")
    keep = np.flatnonzero(loss > 0)
    usable = len(keep) - len(keep) % cfg.steps  # the same whole records per step in both plans
    if usable < cfg.steps:
        raise ValueError(f"{len(keep)} usable records for QLoraConfig.steps={cfg.steps}: each "
                         "step needs at least one; raise records or lower steps")
    keep = keep[:usable]
    return Records(cache, keep.tolist(), lengths[keep].tolist(), loss[keep].tolist(),
                   len(empty) + cache.skipped)


def _split(rows_per_step: int, micro: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) with micro_batch x grad_accum == rows_per_step exactly."""
    micro = max(d for d in range(1, min(micro, rows_per_step) + 1) if rows_per_step % d == 0)
    return micro, rows_per_step // micro


class WholeSteps:
    """The packed windows padded up to whole optimizer steps, so no tail token is left out.

    A pad row is all pad tokens with every label -100, positions 0..seq_len-1: it trains nothing
    and each of its tokens attends to itself and the ones before it (never to nothing, which
    gives NaN attention weights in some kernels).
    """

    def __init__(self, packed: Any, rows: int) -> None:
        self.packed, self.rows = packed, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} of {self.rows}")
        if i < len(self.packed):
            return self.packed[i]
        seq = self.packed.seq_len
        return {"input_ids": torch.full((seq,), self.packed.pad_token_id, dtype=torch.int64),
                "labels": torch.full((seq,), -100, dtype=torch.int64),
                "position_ids": torch.arange(seq)}


def build_dataset(cfg: QLoraConfig, plan: Plan, recs: Records, tokenizer_dir: Path,
                  source: Path, attention: str | None = "sdpa") -> Data:
    """The plan's Dataset over recs; source: the data they were read from (job_records' path).
    attention: the model's attention implementation; where it cannot keep packed records apart
    (diag.data.packing_refused) each record gets a window of its own, and the stats say why."""
    from diag.data import NaiveTextDataset, PackedDataset, packing_refused

    seq = cfg.seq_len
    if plan.pipeline == "naive":
        records = read(cfg, source)
        dataset = NaiveTextDataset([records[i] for i in recs.indices], tokenizer_dir, seq)
        rows_per_step = len(dataset) // cfg.steps
        real = sum(min(n, seq) for n in recs.lengths)
        loss = sum(recs.loss)
        left_out = sum(max(n - seq, 0) for n in recs.lengths)  # truncated at seq_len
        detail = "tokenized per sample in __getitem__, padded to seq_len"
    else:
        cache = _cache(cfg, source, tokenizer_dir)  # a hit: job_records had it made
        refused = packing_refused(attention)
        packed = PackedDataset(cache.folder, seq, records=recs.indices, pack=not refused)
        # every token trains: the tail is padded up to whole steps (fewer than steps pad rows),
        # so both plans train the same records' tokens (both cut a record at seq_len)
        rows_per_step = -(-len(packed) // cfg.steps)
        used = rows_per_step * cfg.steps
        dataset = WholeSteps(packed, used)
        real, loss, left_out = packed.tokens, packed.loss_tokens(), packed.left_out
        how = f"one record per window ({refused})" if refused else \
            "whole records packed by best-fit decreasing, kept apart by position_ids"
        detail = f"token cache {cache.status}, {how}, {used - len(packed)} pad rows"
    micro, accum = _split(rows_per_step, plan.micro_batch)
    slots = rows_per_step * cfg.steps * seq
    stats = {"records": len(recs.indices), "skipped_records": recs.skipped,
             "rows": rows_per_step * cfg.steps, "token_slots": slots, "real_tokens": int(real),
             "left_out_tokens": int(left_out),
             "loss_tokens": int(loss), "padding_share": 1 - real / slots if slots else 0.0,
             "data": detail}
    return Data(dataset, micro, accum, stats)
