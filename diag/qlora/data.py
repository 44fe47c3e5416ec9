"""The QLoRA job's records from diag.data's token cache, the same for both plans, and each plan's
Dataset over them in whole optimizer steps (`build_dataset`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from diag.data import build_token_cache, read_source
from diag.data.records import plan_chunks, split_chunk
from diag.qlora.plans import Plan, fit_micro_batch

PAD_ROWS_LIMIT = 0.25  # share of a step's rows that may be padding to keep the micro-batch

if TYPE_CHECKING:
    from diag.config import JobConfig, QLoraConfig, TrainConfig
    from diag.data import TokenCache


@dataclass(frozen=True)
class Records:
    """The records both plans train on, as the token cache holds them."""

    cache: TokenCache
    indices: list[int]  # each record's place among the source's good records (the cache's)
    lengths: list[int]  # tokens per record, before seq_len cuts
    loss: list[int]  # tokens carrying a loss in its first seq_len
    skipped: int  # records left out: prompt too long for seq_len, or a malformed line

    def pick(self, at: Any) -> Records:
        """The records at these positions, in that order."""
        return Records(self.cache, [self.indices[i] for i in at], [self.lengths[i] for i in at],
                       [self.loss[i] for i in at], self.skipped)


@dataclass(frozen=True)
class Data:
    dataset: Any  # a torch Dataset
    micro_batch: int
    grad_accum: int
    stats: dict[str, Any]  # rows, token_slots, real_tokens, padding_share, ...


def _cache(cfg: JobConfig, source: Path, tokenizer_dir: Path) -> TokenCache:
    return build_token_cache(source, tokenizer_dir, fields=cfg.fields(), on_error=cfg.on_error,
                             limit=cfg.records or None)


def job_records(cfg: QLoraConfig, source: Path, tokenizer_dir: Path) -> Records:
    """The first cfg.records good records at source, counted, as many in each of cfg.steps."""
    recs = counted(cfg, _cache(cfg, source, tokenizer_dir))
    usable = len(recs.indices) - len(recs.indices) % cfg.steps
    if usable < cfg.steps:
        raise ValueError(f"{len(recs.indices)} usable records for QLoraConfig.steps={cfg.steps}: "
                         "each step needs at least one; raise records or lower steps")
    return recs.pick(range(usable))


def counted(cfg: JobConfig, cache: TokenCache) -> Records:
    """The cache's first cfg.records good records (0: all), those with no loss token refused."""
    from diag.data import loss_counts  # diag.data.packing's: imports torch

    n = min(cfg.records, cache.records) if cfg.records else cache.records
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
    return Records(cache, keep.tolist(), lengths[keep].tolist(), loss[keep].tolist(),
                   len(empty) + cache.skipped)


class WholeSteps:
    """The packed windows padded to whole optimizer steps with rows that train nothing."""

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
                "position_ids": torch.arange(seq)}  # 0..seq_len-1: attending to nothing is NaN


def build_dataset(cfg: JobConfig, plan: Plan, recs: Records, tokenizer_dir: Path,
                  source: Path, attention: str | None = "sdpa", steps: int | None = None,
                  rows: Sequence[dict[str, Any]] | None = None) -> Data:
    """The plan's Dataset over recs in `steps` optimizer steps (rows: the naive plan's records)."""
    from diag.data import NaiveTextDataset, PackedDataset, packing_refused

    seq, steps = cfg.seq_len, steps or cfg.steps
    if plan.pipeline == "naive":
        if rows is None:
            records = read_source(source, cfg.fields(), on_error=cfg.on_error, limit=cfg.records)[0]
            rows = [records[i] for i in recs.indices]
        dataset = NaiveTextDataset(rows, tokenizer_dir, seq)
        rows_per_step = len(dataset) // steps
        real = sum(min(n, seq) for n in recs.lengths)
        loss = sum(recs.loss)
        left_out = sum(max(n - seq, 0) for n in recs.lengths)  # truncated at seq_len
        detail = "tokenized per sample in __getitem__, padded to seq_len"
    else:
        refused = packing_refused(attention)
        packed = PackedDataset(recs.cache.folder, seq, records=recs.indices, pack=not refused)
        # the tail padded up to whole steps, and to whole micro-batches where that pads within
        # PAD_ROWS_LIMIT: both plans train the same records' tokens
        rows_per_step = -(-len(packed) // steps)
        micro = min(plan.micro_batch, rows_per_step)
        whole = -(-rows_per_step // micro) * micro
        rows_per_step = whole if whole - rows_per_step <= PAD_ROWS_LIMIT * whole else rows_per_step
        used = rows_per_step * steps
        dataset = WholeSteps(packed, used)
        real, loss, left_out = packed.tokens, packed.loss_tokens(), packed.left_out
        how = f"one record per window ({refused})" if refused else \
            "whole records packed by best-fit decreasing, kept apart by position_ids"
        detail = f"token cache {recs.cache.status}, {how}, {used - len(packed)} pad rows"
    micro = fit_micro_batch(rows_per_step, plan.micro_batch)
    slots = rows_per_step * steps * seq
    stats = {"records": len(recs.indices), "skipped_records": recs.skipped,
             "rows": rows_per_step * steps, "token_slots": slots, "real_tokens": int(real),
             "left_out_tokens": int(left_out), "loss_tokens": int(loss),
             "padding_share": 1 - real / slots if slots else 0.0, "data": detail}
    return Data(dataset, micro, rows_per_step // micro, stats)


@dataclass(frozen=True)
class Split:
    """`diag train`'s records: what trains, in whole optimizer steps, and what is held out."""

    train: Records  # steps_per_epoch x cfg.batch_size records, in the source's order
    eval: Records  # drawn by cfg.seed; never trained on
    steps_per_epoch: int
    dropped: int  # records past an epoch's last whole step: not trained


def train_records(cfg: TrainConfig, source: Path, tokenizer_dir: Path) -> Split:
    """The cache's good records: the eval share drawn by cfg.seed, the rest in whole steps."""
    recs = counted(cfg, _cache(cfg, source, tokenizer_dir))
    held = cfg.held_out(len(recs.indices))  # refused where no step or no eval batch is left
    drawn = np.random.default_rng(cfg.seed).permutation(len(recs.indices))
    rest = np.sort(drawn[held:])
    steps = len(rest) // cfg.batch_size
    return Split(recs.pick(rest[:steps * cfg.batch_size].tolist()),
                 recs.pick(np.sort(drawn[:held]).tolist()), steps,
                 len(rest) - steps * cfg.batch_size)


class ArrowRecords(Sequence):
    """The source's good records at `indices`, memory-mapped from an Arrow file written here."""

    def __init__(self, source: Path, fields: dict[str, str], folder: Path,
                 indices: Sequence[int]) -> None:
        import pyarrow as pa

        self.path, self.indices = folder / "records.arrow", list(indices)
        last, seen, writer, schema = max(self.indices, default=-1) + 1, 0, None, None
        try:
            for chunk in plan_chunks(source, fields):
                if seen >= last:
                    break
                good = split_chunk(chunk, fields, last - seen)[1]
                if good:
                    batch = pa.RecordBatch.from_pylist(good, schema=schema)  # one schema
                    if writer is None:
                        schema = batch.schema
                        writer = pa.ipc.new_file(str(self.path), schema)
                    writer.write_batch(batch)
                seen += len(good)
        finally:
            if writer is not None:
                writer.close()
        self._table: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}  # a worker maps the file itself

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._table is None:
            import pyarrow as pa

            self._table = pa.ipc.open_file(pa.memory_map(str(self.path))).read_all()
        return self._table.slice(self.indices[i], 1).to_pylist()[0]
