"""Preflight's record check at its boundary, against the embedded S3 server: a prompt of exactly
--seq-len tokens leaves nothing to train on and is refused in one line before any work; one
token more of --seq-len passes."""

from __future__ import annotations

import json

import pytest

from diag.config import QLoraConfig
from diag.preflight import preflight

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # an S3 server process, a tokenizer (~3 s)

GOOD = {"instruction": "Sort these words.", "input": "pear apple", "output": "apple pear"}
LONG = {**GOOD, "input": " ".join(["banana"] * 20)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from diag.data import encode_pairs, load_tokenizer
    from diag.embedded import S3Server, ensure_assets

    # the long record's prompt, BOS included, as the job tokenizes it
    prompts, _ = encode_pairs(load_tokenizer(str(ensure_assets().model_dir)), [LONG])
    with S3Server() as s3:
        body = "".join(json.dumps(r) + "\n" for r in (GOOD, LONG, GOOD, GOOD))
        s3.client().put_object(Bucket=s3.bucket, Key="d.jsonl", Body=body.encode())
        yield s3, len(prompts[0])


def _check(s3, monkeypatch, seq_len: int) -> None:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    cfg = QLoraConfig.quick(source=f"s3://{s3.bucket}/d.jsonl", endpoint_url=s3.endpoint_url,
                            seq_len=seq_len, steps=2, warmup_steps=1, records=4)
    preflight(cfg, cfg)


def test_a_prompt_of_exactly_seq_len_tokens_is_refused(served, monkeypatch):
    s3, tokens = served
    with pytest.raises(ValueError) as err:
        _check(s3, monkeypatch, tokens)
    assert str(err.value) == (
        f"--seq-len={tokens}: record 2 of s3://diag/d.jsonl: its prompt is {tokens} tokens and "
        "leaves no response token to train on; raise --seq-len, or pass --on-error skip to "
        "leave such records out (counted)")
    _check(s3, monkeypatch, tokens + 1)  # one response token fits: it trains on that
