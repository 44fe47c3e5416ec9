"""Bad data for the QLoRA job: clear errors or counted skips, as QLoraConfig.on_error says."""

from __future__ import annotations

import json

import pytest

from diag.config import QLoraConfig

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_dir():
    from diag.embedded import ensure_assets

    return ensure_assets().model_dir


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"instruction": "Sort these words.", "input": "pear apple", "output": "apple pear"}


def test_row_without_a_response_raises_or_is_counted(tmp_path, tokenizer_dir):
    from diag.qlora.data import check_records, read

    path = _jsonl(tmp_path / "d.jsonl", [GOOD, {"instruction": "Say hi.", "input": ""}, GOOD,
                                         "{not json", GOOD])
    with pytest.raises(ValueError, match="line 2"):
        read(QLoraConfig.quick(steps=1, warmup_steps=0), path)
    cfg = QLoraConfig.quick(steps=1, warmup_steps=0, on_error="skip")
    records, bad = read(cfg, path)
    assert len(records) == 3 and bad == 2
    assert check_records(cfg, records, tokenizer_dir, bad).skipped == 2


def test_empty_dataset_is_a_clear_error(tmp_path, tokenizer_dir):
    from diag.qlora.data import read

    path = _jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="no usable records"):
        read(QLoraConfig.quick(on_error="skip"), path)


def test_seq_len_below_the_prompt(tmp_path, tokenizer_dir):
    from diag.qlora.data import check_records

    long = {**GOOD, "input": " ".join(["banana"] * 80)}
    records = [GOOD, long, GOOD, GOOD]
    cfg = QLoraConfig.quick(seq_len=80, steps=1, warmup_steps=0)
    with pytest.raises(ValueError, match=r"record 1: .*seq_len=80"):
        check_records(cfg, records, tokenizer_dir)
    kept = check_records(cfg.replace(on_error="skip"), records, tokenizer_dir)
    assert kept.skipped == 1 and len(kept.records) == 3
    assert all(p < 80 for p in kept.prompt_lengths)


def test_too_few_records_for_the_steps(tokenizer_dir):
    from diag.qlora.data import check_records

    with pytest.raises(ValueError, match="steps=3"):
        check_records(QLoraConfig.quick(steps=3), [GOOD, GOOD], tokenizer_dir)
