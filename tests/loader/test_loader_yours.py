"""The loader sweep on the user's own Dataset and step: (x, y) tuples, dicts without masks, and
a batch diag cannot read (one error before the sweep)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import Dataset

from diag.config import LoaderConfig
from diag.loader.sweep import sweep_workers


class Pairs(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), torch.tensor(i % 2)


class Ids(Dataset):  # a dict without attention_mask: tokens are input_ids' size
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return {"input_ids": torch.arange(6) + i}


class Words(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return {"text": f"record {i}"}


CFG = LoaderConfig.quick(workers=[0, 1], batch_size=4, steps=3, repeats=1)
seen: list[int] = []


def test_tuple_batches_sweep_counting_samples():
    seen.clear()
    frame = sweep_workers(CFG, step=lambda batch: seen.append(batch[0].shape[0]), dataset=Pairs())
    assert list(frame["num_workers"]) == [0, 1] and set(frame["pipeline"]) == {"yours"}
    assert (frame["error"] == "").all() and (frame["samples_per_s"] > 0).all()
    assert frame["tokens_per_s"].map(math.isnan).all()  # no tokens in (x, y): not invented
    assert seen and set(seen) == {4}


def test_dicts_without_masks_count_input_ids():
    frame = sweep_workers(CFG, step=lambda batch: batch["input_ids"].sum(), dataset=Ids())
    assert (frame["error"] == "").all()
    ratio = frame["tokens_per_s"] / frame["samples_per_s"]
    assert ratio.round(6).eq(6.0).all()  # 6 ids per sample


def test_a_batch_diag_cannot_read_is_one_error_before_the_sweep():
    calls = []
    with pytest.raises(ValueError, match=r"^dataset/collate_fn: a batch is a dict holding "
                                         r"list; allowed: a tensor"):
        sweep_workers(CFG, step=calls.append, dataset=Words())
    assert calls == []
    with pytest.raises(ValueError, match="pass step="):
        sweep_workers(CFG, dataset=Pairs())


def test_hf_collators_batch_encodings_are_swept_with_their_tokens():
    # DataCollatorWithPadding, ...ForLanguageModeling and ...ForSeq2Seq return a BatchEncoding:
    # a Mapping of tensors, not a dict
    from transformers import (DataCollatorForLanguageModeling, DataCollatorForSeq2Seq,
                              DataCollatorWithPadding)

    from diag.data import hf_tokenizer
    from diag.embedded import ensure_assets

    tokenizer = hf_tokenizer(str(ensure_assets().model_dir))
    # every batch of 4 holds the same lengths, padded to the longest: tokens are the mask's sum
    rows = [tokenizer(f"record {i} " + "word " * (i % 4)) for i in range(16)]
    seq2seq = [{**r, "labels": r["input_ids"]} for r in rows]
    cfg = CFG.replace(workers=[0])
    for collate, data in ((DataCollatorWithPadding(tokenizer), rows),
                          (DataCollatorForLanguageModeling(tokenizer, mlm=False), rows),
                          (DataCollatorForSeq2Seq(tokenizer), seq2seq)):
        frame = sweep_workers(cfg, step=lambda batch: batch["input_ids"].sum(), dataset=data,
                              collate_fn=collate)
        assert (frame["error"] == "").all(), type(collate).__name__
        per_sample = frame["tokens_per_s"] / frame["samples_per_s"]
        real = sum(len(r["input_ids"]) for r in rows[:4]) / 4
        assert per_sample.round(6).eq(round(real, 6)).all(), type(collate).__name__


def test_a_load_that_moves_during_the_sweep_hits_every_setting():
    # the step slows 50x halfway through the sweep (a neighbour starts on a shared box): every
    # setting's epochs are interleaved, so each sees both speeds, and neither setting alone
    # carries the slow half (one setting's repeats after another's would put 0 workers on the
    # fast side and 1 worker on the slow one: a gap the loader never made)
    import time

    cfg = LoaderConfig.quick(workers=[0, 1], batch_size=4, steps=3, repeats=4)
    calls = []
    half = 2 * (4 + 6)  # 2 of 4 rounds: an epoch is 4 batches at 0 workers, 6 at 1 (2 ahead)

    def step(batch):
        calls.append(1)
        # 50 ms: a 1 ms sleep woken late on a busy box (load 8 on 2 cores) still reads < 10 ms
        time.sleep(0.001 if len(calls) <= half else 0.05)

    frame = sweep_workers(cfg, step=step, dataset=Pairs())
    assert (frame["error"] == "").all()
    for _, side in frame.groupby("num_workers"):
        assert side["step_s"].max() > 5 * side["step_s"].min()
