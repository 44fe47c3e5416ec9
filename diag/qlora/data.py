"""The QLoRA job's data, from diag.data's pipeline: the same records for both plans.

`check_records` drops (or refuses) records whose prompt leaves no response token inside
seq_len and counts token slots, real tokens and loss tokens; `build_dataset` makes the plan's
Dataset (per-sample tokenized and padded, or packed from the one token cache of the source, the
folder the loader and accum sweeps read) and splits each optimizer step into micro-batch x
accumulation so both plans take the same steps over the same records.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diag.config import QLoraConfig
    from diag.qlora.plans import Plan


@dataclass(frozen=True)
class Records:
    """The records both plans train on, and what tokenizing them gives."""

    records: list[dict[str, str]]
    indices: list[int]  # each record's place among the source's good records (the token cache's)
    lengths: list[int]  # tokens per record (BOS + prompt + response + EOS)
    prompt_lengths: list[int]
    skipped: int  # records left out: prompt too long for seq_len, or a malformed line


@dataclass(frozen=True)
class Data:
    dataset: Any  # a torch Dataset of {"input_ids", "attention_mask", "labels"} rows
    micro_batch: int
    grad_accum: int
    stats: dict[str, Any]  # rows, token_slots, real_tokens, loss_tokens, padding_share, ...


def read(cfg: QLoraConfig, path: Path) -> tuple[list[dict[str, str]], int]:
    """The first cfg.records good records of the data at path (a JSONL or Parquet file, or a
    folder of shards: diag.data), read with cfg's fields, and the count of bad rows."""
    from diag.data import read_source

    records, problems = read_source(path, cfg.fields(), on_error=cfg.on_error, limit=cfg.records)
    if not records:
        raise ValueError(f"--source: the data at {path.name} holds no usable records "
                         f"({len(problems)} that do not fit): nothing to train on")
    return records[: cfg.records], len(problems)


def check_records(cfg: QLoraConfig, records: list[dict[str, str]], tokenizer_dir: Path,
                  bad_lines: int = 0) -> Records:
    """Records whose prompt fills seq_len train on nothing (every label is -100): refused with
    on_error="raise", counted and left out with "skip"."""
    from diag.data import encode_batch, load_tokenizer, render_chat

    tokenizer = load_tokenizer(str(tokenizer_dir))
    records = render_chat(records, tokenizer)  # --messages-field: the model's chat template
    ids, prompts = encode_batch(tokenizer, records)
    keep, skipped = [], 0
    for i, prompt in enumerate(prompts):
        if prompt < cfg.seq_len:
            keep.append(i)
            continue
        if cfg.on_error == "raise":
            raise ValueError(f"record {i}: its prompt is {prompt} tokens and "
                             f"QLoraConfig.seq_len={cfg.seq_len} leaves no response token to "
                             "train on; raise seq_len, or pass on_error='skip' to leave such "
                             "records out (counted)")
        skipped += 1
    usable = len(keep) - len(keep) % cfg.steps  # the same whole records per step in both plans
    if usable < cfg.steps:
        raise ValueError(f"{len(keep)} usable records for QLoraConfig.steps={cfg.steps}: each "
                         "step needs at least one; raise records or lower steps")
    keep = keep[:usable]
    return Records([records[i] for i in keep], keep, [len(ids[i]) for i in keep],
                   [prompts[i] for i in keep], skipped + bad_lines)


def _split(rows_per_step: int, micro: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) with micro_batch x grad_accum == rows_per_step exactly."""
    micro = max(d for d in range(1, min(micro, rows_per_step) + 1) if rows_per_step % d == 0)
    return micro, rows_per_step // micro


class WholeSteps:
    """The packed windows padded up to whole optimizer steps, so no tail token is left out.

    A pad row is all pad tokens with every label -100: it trains nothing. It attends to itself
    (mask 1): a row with no visible token would give NaN attention weights in some kernels.
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
                "attention_mask": torch.ones(seq, dtype=torch.int64),
                "labels": torch.full((seq,), -100, dtype=torch.int64)}


def build_dataset(cfg: QLoraConfig, plan: Plan, recs: Records, tokenizer_dir: Path,
                  source: Path) -> Data:
    """The plan's Dataset over recs; source: the data they were read from (read's path)."""
    import numpy as np

    from diag.data import NaiveTextDataset, PackedDataset

    seq = cfg.seq_len
    if plan.pipeline == "naive":
        dataset = NaiveTextDataset(recs.records, tokenizer_dir, seq)
        rows_per_step = len(dataset) // cfg.steps
        real = sum(min(n, seq) for n in recs.lengths)
        loss = sum(max(min(n, seq) - p, 0) for n, p in zip(recs.lengths, recs.prompt_lengths))
        left_out = sum(max(n - seq, 0) for n in recs.lengths)  # truncated at seq_len
        detail = "tokenized per sample in __getitem__, padded to seq_len"
    else:
        from diag.data import build_token_cache

        # the whole source, as the loader and accum sweeps tokenize it (one key: a hit after
        # them or a first start); "skip": read() already refused a bad row among these records
        cache = build_token_cache(source, tokenizer_dir, fields=cfg.fields(), on_error="skip")
        lengths = np.diff(np.load(cache.folder / "offsets.npy"))[recs.indices]
        assert lengths.tolist() == recs.lengths, "the token cache's records are not read()'s"
        packed = PackedDataset(cache.folder, seq, records=recs.indices)
        # every token trains: the tail is padded up to whole steps (fewer than steps pad rows),
        # so both plans train the same records' tokens (naive loses only what seq_len cuts)
        rows_per_step = -(-len(packed) // cfg.steps)
        used = rows_per_step * cfg.steps
        dataset = WholeSteps(packed, used)
        real = packed.tokens
        loss = packed.loss_tokens()
        left_out = 0
        detail = f"token cache {cache.status}, packed, {used - len(packed)} pad rows"
    micro, accum = _split(rows_per_step, plan.micro_batch)
    slots = rows_per_step * cfg.steps * seq
    stats = {"records": len(recs.records), "skipped_records": recs.skipped,
             "rows": rows_per_step * cfg.steps, "token_slots": slots, "real_tokens": int(real),
             "left_out_tokens": int(left_out),
             "loss_tokens": int(loss), "padding_share": 1 - real / slots if slots else 0.0,
             "data": detail}
    return Data(dataset, micro, accum, stats)
