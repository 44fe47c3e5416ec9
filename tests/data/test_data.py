"""diag.data: prompt template, JSONL checks, naive vs packed labels, the token cache."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from diag.data import (IGNORE_INDEX, NaiveTextDataset, PackedDataset, best_fit_decreasing,
                       build_token_cache, encode_pairs, format_prompt, load_tokenizer,
                       read_source)
from diag.data.tokens import MEMO
from diag.embedded import ensure_assets, synthetic_records

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok_dir() -> str:
    return str(ensure_assets().model_dir)


def test_format_prompt_with_and_without_input():
    prompt, response = format_prompt({"instruction": "Sort.", "input": "b a", "output": "a b"})
    assert prompt == "### Instruction:\nSort.\n\n### Input:\nb a\n\n### Response:\n"
    assert response == "a b"
    prompt, _ = format_prompt({"instruction": "What is 1 + 1?", "input": "", "output": "2"})
    assert "### Input" not in prompt and prompt.endswith("### Response:\n")


def _bad_jsonl(path: Path) -> Path:
    good = json.dumps({"instruction": "Say hi.", "input": "", "output": "hi"})
    lines = [good.encode(), b'{"instruction": "x", "input": "", "output": ',  # 2: invalid JSON
             json.dumps({"instruction": "x", "output": "y"}).encode(),  # 3: no input
             b"", json.dumps({"instruction": "x", "input": "", "output": "  "}).encode(),  # 5
             b'{"instruction": "caf\xe9", "input": "", "output": "y"}',  # 6: latin-1 byte
             b"[1, 2]", good.encode()]  # 7: not an object, 8: good
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_read_source_lists_every_bad_line_with_its_number(tmp_path: Path):
    records, problems = read_source(_bad_jsonl(tmp_path / "bad.jsonl"), on_error="skip")
    assert len(records) == 2
    assert problems[["line", "problem"]].values.tolist() == [
        [2, "invalid_json"], [3, "missing_field"], [5, "empty_text"], [6, "invalid_utf8"],
        [7, "not_an_object"]]
    assert "input" in problems.loc[1, "detail"] and "output" in problems.loc[2, "detail"]


def test_read_source_raise_names_the_line(tmp_path: Path):
    with pytest.raises(ValueError, match=r"line 2: invalid_json.*on_error='skip'"):
        read_source(_bad_jsonl(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="on_error='ignore': allowed values are 'raise', 'skip'"):
        read_source(tmp_path / "bad.jsonl", on_error="ignore")


def test_a_file_read_again_is_parsed_once_until_it_changes(tmp_path: Path, monkeypatch):
    from diag.data import records as module

    path = _bad_jsonl(tmp_path / "bad.jsonl")
    parsed = []
    real = module.plan_chunks  # called once per parse
    monkeypatch.setattr(module, "plan_chunks", lambda *a: parsed.append(a[0]) or real(*a))
    first, problems = read_source(path, on_error="skip", cached=True)
    first.append({"prompt": "", "response": "a caller's own list"})
    problems.loc[0, "problem"] = "a caller's own frame"
    again, problems_again = read_source(path, on_error="skip", cached=True)
    assert len(parsed) == 1 and len(again) == 2  # the cache kept neither change
    assert problems_again.loc[0, "problem"] == "invalid_json"
    read_source(path, on_error="skip")  # uncached, as a timed job start reads: parsed again
    assert len(parsed) == 2
    parsed.pop()
    read_source(path, on_error="skip", cached=True, limit=1)  # another question is another read
    assert len(parsed) == 2
    good = json.dumps({"instruction": "Say bye.", "input": "", "output": "bye"})
    path.write_text(good + "\n")  # a new size: read again
    changed, problems = read_source(path, on_error="skip", cached=True)
    assert len(parsed) == 3 and len(changed) == 1 and problems.empty
    keep = module._read_once.cache_info().maxsize
    for limit in range(100, 100 + keep + 2):  # bounded: the oldest go first
        read_source(path, on_error="skip", cached=True, limit=limit)
    assert module._read_once.cache_info().currsize == keep
    read_source(path, on_error="skip", cached=True, limit=100)  # the oldest was dropped: read again
    assert len(parsed) == 3 + keep + 2 + 1
    monkeypatch.setattr(module, "_READ_MAX_BYTES", path.stat().st_size - 1)
    module._read_once.cache_clear()
    read_source(path, on_error="skip", cached=True)
    read_source(path, on_error="skip", cached=True)  # above the size kept: read each time
    assert len(parsed) == 3 + keep + 2 + 1 + 2 and module._read_once.cache_info().currsize == 0


def test_sample_jsonl_reads_clean():
    records, problems = read_source(ROOT / "data" / "sample.jsonl")
    assert records and problems.empty


def _encoded(tokenizer, records):
    """Each record's ids (BOS + prompt + response + EOS), batched, and its prompt length."""
    prompts, responses = encode_pairs(tokenizer, records)
    return ([p + r + [tokenizer.eos_token_id] for p, r in zip(prompts, responses)],
            [len(p) for p in prompts])


def test_naive_labels_mask_prompt_and_padding(tok_dir: str):
    records = list(synthetic_records(20, seed=3))
    ds = NaiveTextDataset(records, tok_dir, seq_len=128)
    tok = load_tokenizer(tok_dir)
    ids, prompt_lens = _encoded(tok, records)
    for i in range(len(records)):
        item = ds[i]
        assert {k: v.shape for k, v in item.items()} == {k: (128,) for k in item}
        n = int(item["attention_mask"].sum())
        assert item["input_ids"][:n].tolist() == ids[i][:128]  # one-at-a-time == batched
        assert (item["input_ids"][n:] == tok.pad_token_id).all()
        labels = item["labels"]
        assert (labels[: prompt_lens[i]] == IGNORE_INDEX).all()
        assert (labels[n:] == IGNORE_INDEX).all()
        assert labels[prompt_lens[i]:n].tolist() == ids[i][prompt_lens[i]:n]
        assert labels[n - 1] == tok.eos_token_id  # the model learns to stop
    short = NaiveTextDataset(records, tok_dir, seq_len=8)[0]  # truncated, no pad
    assert short["attention_mask"].tolist() == [1] * 8


def test_packed_windows_hold_whole_records_each_on_its_own_positions(tok_dir: str,
                                                                     tmp_path: Path):
    records = [*synthetic_records(60, seed=1),
               {"instruction": "Repeat.", "input": "", "output": "la " * 80}]
    cache = build_token_cache(records, tok_dir, cache_dir=tmp_path)
    ds = PackedDataset(cache.folder, seq_len=96)
    ids, prompt_lens = _encoded(load_tokenizer(tok_dir), records)
    want = sorted(tuple(seq[:96]) for seq in ids)  # a record past seq_len is cut there
    assert len(ids[-1]) > 96 and len(ds) < len(records)
    assert ds.left_out == len(ids[-1]) - 96
    got, labels_of, loss = [], {}, 0
    for w in range(len(ds)):
        item = ds[w]
        assert set(item) == {"input_ids", "labels", "position_ids"}  # no mask: see packing.py
        starts = (item["position_ids"] == 0).nonzero().flatten().tolist() + [96]
        for lo, hi in zip(starts, starts[1:]):
            piece = tuple(item["input_ids"][lo:hi].tolist())
            if (item["labels"][lo:hi] == IGNORE_INDEX).all():  # the tail: padding only
                assert hi == 96 and set(piece) == {ds.pad_token_id}
                continue
            assert item["position_ids"][lo:hi].tolist() == list(range(hi - lo))
            got.append(piece)
            labels_of[piece] = item["labels"][lo:hi].tolist()
            loss += int((item["labels"][lo:hi] != IGNORE_INDEX).sum())
    assert sorted(got) == want and ds.tokens == sum(map(len, want))
    for seq, n in zip(ids, prompt_lens):  # loss on the response and EOS, never the 1st token
        kept = seq[:96]
        assert labels_of[tuple(kept)] == [IGNORE_INDEX if j < max(n, 1) else t
                                          for j, t in enumerate(kept)]
    assert ds.loss_tokens() == loss
    clone = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets
    assert torch.equal(clone[1]["labels"], ds[1]["labels"])
    with pytest.raises(IndexError):
        ds[len(ds)]
    alone = PackedDataset(cache.folder, seq_len=96, pack=False)  # the fallback
    assert len(alone) == len(records) and alone.tokens == ds.tokens


def test_no_loss_crosses_a_record_boundary(tmp_path: Path):
    # records whose every token carries loss (a text field, a tokenizer without BOS): in a window
    # the first token of a record would be predicted from the record before it
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "pad_token_id": 0}))
    np.array([5, 6, 7, 8, 9], np.uint16).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "loss_mask.npy", np.ones(5, np.uint8))
    np.save(tmp_path / "offsets.npy", np.array([0, 3, 5], np.int64))
    item = PackedDataset(tmp_path, seq_len=6)[0]
    assert item["input_ids"].tolist() == [5, 6, 7, 8, 9, 0]
    assert item["labels"].tolist() == [IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 0]
    assert PackedDataset(tmp_path, seq_len=6).loss_tokens() == 3


@pytest.mark.parametrize("lengths, capacity, chunk, windows", [
    ([5, 4, 3, 3, 2, 1], 8, 1000, [[0, 2], [1, 3, 5], [4]]),  # longest first, tightest fit
    ([5, 4, 3, 3, 2, 1], 8, 3, [[0, 2], [1], [3, 4, 5]]),  # a window never spans two chunks
    ([8, 8], 8, 1000, [[0], [1]]),
])
def test_best_fit_decreasing(lengths, capacity, chunk, windows):
    order, bounds = best_fit_decreasing(np.array(lengths), capacity, chunk)
    got = [order[a:b].tolist() for a, b in zip(bounds, bounds[1:])]
    assert got == windows


def test_packed_dataset_in_dataloader_workers(tok_dir: str, tmp_path: Path):
    cache = build_token_cache(list(synthetic_records(40)), tok_dir, cache_dir=tmp_path)
    ds = PackedDataset(cache.folder, seq_len=32)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    batches = list(loader)
    assert sum(len(b["input_ids"]) for b in batches) == len(ds)
    assert torch.equal(batches[0]["labels"][1], ds[1]["labels"])


def test_token_cache_hit_then_stale_data_and_tokenizer(tok_dir: str, tmp_path: Path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records(50)))
    first = build_token_cache(data, tok_dir, cache_dir=tmp_path / "c")
    assert first.status == "built" and first.records == 50
    hit = build_token_cache(data, tok_dir, cache_dir=tmp_path / "c")
    assert hit.status == "hit" and hit.key == first.key and hit.folder == first.folder
    # the data changed: same path, a different key, rebuilt with the new records' tokens
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records(30, seed=9)))
    stale = build_token_cache(data, tok_dir, cache_dir=tmp_path / "c")
    assert stale.status == "rebuilt: data changed" and stale.records == 30
    assert stale.key != first.key and stale.tokens != first.tokens
    # the tokenizer changed (a token added): rebuilt, never reused
    other = tmp_path / "tok"
    shutil.copytree(tok_dir, other)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(other)  # not the cached object
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(other)
    changed = build_token_cache(data, other, cache_dir=tmp_path / "c")
    assert changed.status == "rebuilt: tokenizer changed"
    # a torn cache (meta.json lost) is rebuilt, not read; no temporary folder is left behind
    (changed.folder / "meta.json").unlink()
    torn = build_token_cache(data, other, cache_dir=tmp_path / "c")
    assert torn.status == "rebuilt: the old cache was incomplete" and torn.tokens == changed.tokens
    assert [p.name for p in (tmp_path / "c").iterdir() if p.name != MEMO] == [torn.folder.name]


def test_token_cache_skips_malformed_rows(tok_dir: str, tmp_path: Path):
    cache = build_token_cache(_bad_jsonl(tmp_path / "bad.jsonl"), tok_dir, cache_dir=tmp_path)
    assert cache.records == 2 and cache.problems["line"].tolist() == [2, 3, 5, 6, 7]
    assert build_token_cache(tmp_path / "bad.jsonl", tok_dir, cache_dir=tmp_path).problems[
        "line"].tolist() == [2, 3, 5, 6, 7]  # a hit reports them too
    with pytest.raises(ValueError, match="line 2"):
        build_token_cache(tmp_path / "bad.jsonl", tok_dir, cache_dir=tmp_path / "r",
                          on_error="raise")


def test_bad_sizes_name_the_field(tok_dir: str, tmp_path: Path):
    with pytest.raises(ValueError, match="seq_len=0"):
        NaiveTextDataset([], tok_dir, seq_len=0)
    for name in ("num_proc", "limit", "chunk_bytes"):
        with pytest.raises(ValueError, match=f"{name}=0: must be a whole number >= 1"):
            build_token_cache([], tok_dir, cache_dir=tmp_path, **{name: 0})
    with pytest.raises(ValueError, match="tokenizer_dir"):
        NaiveTextDataset([], tmp_path, seq_len=16)


def test_a_cache_built_with_other_fields_is_not_a_hit(tok_dir: str, tmp_path: Path):
    # the same file read with its fields swapped is other records: the mapping is in the key
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"q": f"Sort: pear apple {i}", "a": f"apple pear {i}"})
                            + "\n" for i in range(8)))
    first = build_token_cache(data, tok_dir, fields={"prompt": "q", "response": "a"},
                              cache_dir=tmp_path / "c", num_proc=1)
    loss = np.load(first.folder / "loss_mask.npy").sum()
    swapped = build_token_cache(data, tok_dir, fields={"prompt": "a", "response": "q"},
                                cache_dir=tmp_path / "c", num_proc=1)
    assert swapped.status == "rebuilt: settings changed" and swapped.key != first.key
    assert np.load(swapped.folder / "loss_mask.npy").sum() != loss  # on the other field's tokens


TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant', "
            "'system'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}{% if loop.first "
            "and m.role == 'system' %}{% continue %}{% endif %}<|{{ m.role }}|>\n"
            "{{ m.content | trim }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}"
            "<|assistant|>\n{% endif %}")


def test_the_tokenizers_only_tokenizer_gives_transformers_ids_and_chat_text(tmp_path):
    """Preflight and the token cache's workers load tokenizer.json with `tokenizers` alone: the
    same ids, special tokens and chat template text as transformers' fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from diag.data import encode_pairs, hf_tokenizer, load_tokenizer
    from diag.data.text import TextTokenizer
    from diag.embedded import ensure_assets

    saved = PreTrainedTokenizerFast.from_pretrained(ensure_assets().model_dir)
    saved.chat_template = TEMPLATE
    saved.save_pretrained(tmp_path)
    light, full = load_tokenizer(str(tmp_path)), hf_tokenizer(str(tmp_path))
    assert isinstance(light, TextTokenizer)
    assert [light.bos_token_id, light.eos_token_id, light.pad_token_id, len(light)] == [
        full.bos_token_id, full.eos_token_id, full.pad_token_id, len(full)]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " Sort: b a "},
            {"role": "assistant", "content": "a b"}]
    records = [*read_source(ensure_assets().dataset, limit=300)[0], {"messages": chat}]
    assert encode_pairs(light, records) == encode_pairs(full, records)
    for generate in (True, False):
        assert light.apply_chat_template(chat, add_generation_prompt=generate) == \
            full.apply_chat_template(chat, tokenize=False, add_generation_prompt=generate)
    with pytest.raises(Exception, match="bad role tool"):
        light.apply_chat_template([{"role": "tool", "content": "x"}])
