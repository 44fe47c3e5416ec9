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
    from diag.data import read_source
    from diag.qlora.data import job_records

    path = _jsonl(tmp_path / "d.jsonl", [GOOD, {"instruction": "Say hi.", "input": ""}, GOOD,
                                         "{not json", GOOD, GOOD, "{not json either"])
    with pytest.raises(ValueError, match="line 2"):
        job_records(QLoraConfig.quick(steps=1, warmup_steps=0), path, tokenizer_dir)
    cfg = QLoraConfig.quick(records=3, steps=1, warmup_steps=0, on_error="skip")
    assert len(read_source(path, cfg.fields(), on_error="skip", limit=3)[0]) == 3  # naive plan's
    recs = job_records(cfg, path, tokenizer_dir)
    assert recs.indices == [0, 1, 2] and recs.skipped == 2  # not line 7: past the 3rd record
    whole = job_records(cfg.replace(records=12), path, tokenizer_dir)
    assert len(whole.indices) == 4 and whole.skipped == 3
    assert job_records(cfg, path, tokenizer_dir).skipped == 2  # served by the whole cache
    first = job_records(cfg.replace(records=1, on_error="raise"), path, tokenizer_dir)
    assert first.indices == [0] and first.skipped == 0  # its read ends before line 2


def test_empty_dataset_is_a_clear_error(tmp_path, tokenizer_dir):
    from diag.qlora.data import job_records

    path = _jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="no usable records"):
        job_records(QLoraConfig.quick(on_error="skip"), path, tokenizer_dir)


def test_seq_len_below_the_prompt(tmp_path, tokenizer_dir):
    from diag.qlora.data import job_records

    long = {**GOOD, "input": " ".join(["banana"] * 80)}
    path = _jsonl(tmp_path / "d.jsonl", [GOOD, long, GOOD, GOOD])
    cfg = QLoraConfig.quick(seq_len=80, steps=1, warmup_steps=0)
    with pytest.raises(ValueError, match=r"record 1: .*seq_len=80"):
        job_records(cfg, path, tokenizer_dir)
    kept = job_records(cfg.replace(on_error="skip"), path, tokenizer_dir)
    assert kept.skipped == 1 and kept.indices == [0, 2, 3] and min(kept.loss) > 0


def test_too_few_records_for_the_steps(tmp_path, tokenizer_dir):
    from diag.qlora.data import job_records

    with pytest.raises(ValueError, match="steps=3"):
        job_records(QLoraConfig.quick(steps=3), _jsonl(tmp_path / "d.jsonl", [GOOD, GOOD]),
                    tokenizer_dir)


def test_a_refused_run_qlora_writes_no_run_file(tmp_path, tokenizer_dir):
    # the Python API checks before it claims --out-dir, as the CLI does: a refused run leaves no
    # run file that a later run with fixed settings would be refused by
    from diag.qlora import run_qlora

    path = _jsonl(tmp_path / "d.jsonl", [GOOD, "{not json", GOOD, GOOD])
    cfg = QLoraConfig.quick(source=str(path), model=str(tokenizer_dir), records=4, steps=1,
                            warmup_steps=0, out_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="line 2"):
        run_qlora(cfg)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
