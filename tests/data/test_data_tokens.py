"""diag.data.tokens: one streamed token cache for the loader sweep, the accum sweep and the QLoRA
job; a build killed or out of room is never taken; the arrays do not depend on how the records
were cut into chunks, processes or shards; both plans of the job train the same tokens."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diag.config import LoaderConfig, QLoraConfig
from diag.data import ARRAYS, IGNORE_INDEX, build_token_cache, ensure_tokens
from diag.data.tokens import MEMO
from diag.embedded import ensure_assets, synthetic_dataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok_dir() -> str:
    return str(ensure_assets().model_dir)


def _arrays(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in ARRAYS}


def _left(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != MEMO)


def test_loader_accum_and_qlora_share_one_cache_built_once(tok_dir, tmp_path, monkeypatch):
    from diag.loader.sweep import make_dataset
    from diag.qlora.data import build_dataset, job_records
    from diag.qlora.plans import Plan

    monkeypatch.setenv("DIAG_HOME", str(tmp_path / "home"))
    data = synthetic_dataset(tmp_path / "d.jsonl", records=80)
    landed = tmp_path / "landed" / "d.jsonl"  # the QLoRA job reads its own copy of the data
    landed.parent.mkdir()
    shutil.copy(data, landed)

    _, loader = make_dataset("packed", LoaderConfig.quick(), str(data), tok_dir)
    assert loader["cache"] == "built" and loader["records"] == 44  # what the sweep draws
    accum = ensure_tokens(tok_dir, data)  # every record: the prefix is served by it, dropped
    cfg = QLoraConfig.quick()
    recs = job_records(cfg, landed, Path(tok_dir))
    plan = dataclasses.replace(Plan.naive(), pipeline="packed")
    job = build_dataset(cfg, plan, recs, Path(tok_dir), landed)
    assert job.stats["data"].startswith("token cache hit")
    assert _left(tmp_path / "home" / "tokens") == [accum.path.parent.name]
    assert accum.path.name == "train.bin" and accum.dtype == "uint16" and recs.cache.complete
    assert build_token_cache(data, tok_dir).status == "hit"
    assert make_dataset("packed", LoaderConfig.quick(), str(data), tok_dir)[1]["cache"] == "hit"


KILLED_BUILD = """
import os, signal, sys
import diag.data.stream as stream
appended, append = [], stream.Arrays.append
def killed(self, part):  # dies with some chunks written and no meta.json
    append(self, part)
    appended.append(1)
    if len(appended) == int(sys.argv[4]):
        for f in self.files.values():  # on disk: a kill after one or two ~2.5 KB chunks
            f.flush()  # lost them in the writer's 8 KB buffer (empty train.bin: 2 of 7 kill points)
        os.kill(os.getpid(), signal.SIGKILL)
stream.Arrays.append = killed
from diag.data import build_token_cache
build_token_cache(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3], num_proc=1, chunk_bytes=4000)
"""


@pytest.mark.slow
def test_a_build_killed_at_a_random_chunk_is_rebuilt_identical(tok_dir, tmp_path):
    data = synthetic_dataset(tmp_path / "d.jsonl", records=400)  # ~53 KB: a dozen chunks
    whole = build_token_cache(data, tok_dir, cache_dir=tmp_path / "whole", num_proc=2,
                              chunk_bytes=9000)
    kill_at = random.randrange(1, 8)
    cache_dir = tmp_path / "tokens"
    done = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(data), tok_dir,
                           str(cache_dir), str(kill_at)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == -9, f"killed after chunk {kill_at}: {done.stderr}"
    left = [p for p in cache_dir.iterdir() if p.name != MEMO]
    assert len(left) == 1 and ".tmp-" in left[0].name  # arrays, never swapped in
    assert (left[0] / "train.bin").stat().st_size and not (left[0] / "meta.json").exists()

    cache = build_token_cache(data, tok_dir, cache_dir=cache_dir)
    assert cache.status == "built" and _left(cache_dir) == [cache.folder.name]
    # other chunk sizes and processes, an interrupted build before: the same bytes
    assert _arrays(cache.folder) == _arrays(whole.folder), f"killed after chunk {kill_at}"

    with open(cache.folder / "train.bin", "r+b") as f:  # a cache torn afterwards: not taken
        f.truncate(10)
    torn = build_token_cache(data, tok_dir, cache_dir=cache_dir)
    assert torn.status == "rebuilt: the old cache was incomplete"
    assert _arrays(torn.folder) == _arrays(whole.folder)


OUT_OF_ROOM = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))  # no file past 20 KB
from diag.data import build_token_cache
try:
    build_token_cache(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3], num_proc=1)
except RuntimeError as err:
    print(err)
"""


@pytest.mark.slow
def test_a_build_out_of_room_says_so_in_one_line_and_leaves_nothing(tok_dir, tmp_path):
    data = synthetic_dataset(tmp_path / "d.jsonl", records=300)  # ~60 KB of ids
    done = subprocess.run([sys.executable, "-c", OUT_OF_ROOM, str(data), tok_dir,
                           str(tmp_path / "tokens")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "nothing was kept" in done.stdout
    assert "File too large" in done.stdout and _left(tmp_path / "tokens") == []


def test_shards_chunks_and_processes_give_the_same_arrays(tok_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = synthetic_dataset(tmp_path / "d.jsonl", records=90)
    lines = data.read_text().splitlines(keepends=True)
    shards = tmp_path / "shards"
    (shards / "b").mkdir(parents=True)
    (shards / "a.jsonl").write_text("".join(lines[:30]))
    pq.write_table(pa.Table.from_pylist([json.loads(x) for x in lines[30:60]]),
                   shards / "b" / "c.parquet", row_group_size=7)
    (shards / "b" / "d.jsonl").write_text("".join(lines[60:]))
    one = build_token_cache(data, tok_dir, cache_dir=tmp_path / "one", num_proc=1)
    cut = build_token_cache(shards, tok_dir, cache_dir=tmp_path / "cut", num_proc=2,
                            chunk_bytes=1500)
    assert cut.key != one.key and _arrays(cut.folder) == _arrays(one.folder)
    first = build_token_cache(shards, tok_dir, cache_dir=tmp_path / "cut", limit=40)
    assert first.status == "hit" and first.records == 90  # the whole cache serves a prefix


def test_a_prefix_reads_a_part_and_the_key_is_not_rehashed(tok_dir, tmp_path, monkeypatch):
    import diag.data.tokens as identity

    data = synthetic_dataset(tmp_path / "d.jsonl", target_mb=0.3)
    hashed = []
    real = identity.file_sha256
    monkeypatch.setattr(identity, "file_sha256", lambda p: hashed.append(p) or real(p))
    root = tmp_path / "tokens"
    some = build_token_cache(data, tok_dir, cache_dir=root, limit=20)
    meta = json.loads((some.folder / "meta.json").read_text())
    assert some.records == 20 and not some.complete and meta["build"]["bytes"] < 100_000
    assert meta["build"]["tokens_per_s"] > 0 and meta["build"]["mb_per_s"] > 0
    assert build_token_cache(data, tok_dir, cache_dir=root, limit=10).status == "hit"
    assert len(hashed) == 1  # once, on the first call: its size and mtime say it is unchanged
    # landed by diag.storage.land: its manifest's ETag and checksum are the identity
    (tmp_path / "d.jsonl.diag-manifest.json").write_text(json.dumps(
        {"url": "s3://b/d.jsonl", "objects": [{"key": "d.jsonl", "size": data.stat().st_size,
                                               "etag": "e1", "digest": "crc32:AAAA"}]}))
    whole = build_token_cache(data, tok_dir, cache_dir=root)
    assert whole.complete and whole.records > 20 and len(hashed) == 1
    assert _left(root) == [whole.folder.name]  # the prefix is served by it: dropped
    data.write_text(data.read_text()[:5000])  # changed after landing: hashed again
    assert build_token_cache(data, tok_dir, cache_dir=root).status == "rebuilt: data changed"
    assert len(hashed) == 2


def test_bad_sources_get_one_line_and_leave_nothing(tok_dir, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import diag.data.stream as stream

    root = tmp_path / "tokens"
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.jsonl holds no usable records \(0 that"):
        build_token_cache(tmp_path / "empty.jsonl", tok_dir, cache_dir=root)
    shards = tmp_path / "shards"
    shards.mkdir()
    good = {"instruction": "Say hi.", "input": "", "output": "hi"}
    pq.write_table(pa.Table.from_pylist([good]), shards / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{**good, "output": 7}]), shards / "b.parquet")
    with pytest.raises(ValueError, match=r"^--source: b.parquet: column 'output' is int64, "
                                         r"a.parquet's is string: the shards' schemas differ"):
        build_token_cache(shards, tok_dir, cache_dir=root)
    (shards / "b.parquet").unlink()
    lines = [json.dumps({**good, "output": " "}), json.dumps(good), "{oops"]
    (shards / "c.jsonl").write_text("\n".join(lines) + "\n")
    skipped = build_token_cache(shards, tok_dir, cache_dir=root)
    assert skipped.problems[["line", "problem"]].values.tolist() == [
        ["c.jsonl:1", "empty_text"], ["c.jsonl:3", "invalid_json"]] and skipped.records == 2
    with pytest.raises(ValueError, match=r"c.jsonl: line 1: empty_text \(output is empty\)"):
        build_token_cache(shards, tok_dir, cache_dir=root, on_error="raise")

    append = stream.Arrays.append  # a shard deleted while the build reads the first one
    monkeypatch.setattr(stream.Arrays, "append", lambda self, part: (
        append(self, part), (shards / "c.jsonl").unlink(missing_ok=True)))
    with pytest.raises(ValueError, match=r"c.jsonl disappeared while its token cache was built"):
        build_token_cache(shards, tok_dir, cache_dir=root, rebuild=True, num_proc=1)
    assert _left(root) == [skipped.folder.name]  # the old cache stays; no half of a new one


def test_both_plans_train_the_same_records_and_tokens(tok_dir, tmp_path):
    from diag.qlora.data import build_dataset, job_records
    from diag.qlora.plans import Plan

    data = synthetic_dataset(tmp_path / "d.jsonl", records=11)
    with open(data, "a") as f:  # one record past seq_len: cut at seq_len by both plans
        f.write(json.dumps({"instruction": "Repeat.", "input": "", "output": "la " * 250}) + "\n")
    cfg = QLoraConfig.quick(seq_len=192, steps=3)
    recs = job_records(cfg, data, Path(tok_dir))
    plans = {p: build_dataset(cfg, dataclasses.replace(Plan.naive(), pipeline=p), recs,
                              Path(tok_dir), data) for p in ("naive", "packed")}
    seen = {}
    for name, got in plans.items():
        rows = [got.dataset[i] for i in range(len(got.dataset))]
        pieces, loss = [], 0
        for row in rows:
            if name == "naive":
                n = int(row["attention_mask"].sum())
                cuts = [(0, n)]
                loss += int((row["labels"][1:n] != IGNORE_INDEX).sum())  # shifted: 1st unused
            else:
                starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
                cuts = [c for c in zip(starts, starts[1:] + [cfg.seq_len])
                        if (row["labels"][c[0]:c[1]] != IGNORE_INDEX).any()]
                loss += int((row["labels"] != IGNORE_INDEX).sum())
            pieces += [tuple(row["input_ids"][a:b].tolist()) for a, b in cuts]
        seen[name] = sorted(pieces)
        assert loss == got.stats["loss_tokens"], name
        assert sum(map(len, pieces)) == got.stats["real_tokens"], name
    assert seen["naive"] == seen["packed"] and len(seen["naive"]) == 12
    stats = {p: got.stats for p, got in plans.items()}
    for key in ("records", "real_tokens", "loss_tokens", "left_out_tokens"):
        assert stats["naive"][key] == stats["packed"][key], key
    assert stats["packed"]["left_out_tokens"] > 0
    assert stats["packed"]["padding_share"] < stats["naive"]["padding_share"]
    # an attention that ignores position_ids: a window per record, and the stats say why
    alone = build_dataset(cfg, dataclasses.replace(Plan.naive(), pipeline="packed"), recs,
                          Path(tok_dir), data, attention="my_kernel")
    assert alone.stats["rows"] == 12 and "'my_kernel' gets no packed-sequence mask" in \
        alone.stats["data"] and alone.stats["loss_tokens"] == stats["packed"]["loss_tokens"]


def test_a_changed_shard_is_tokenized_alone_and_its_neighbours_copied(tok_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        synthetic_dataset(src / f"part-{i}.jsonl", records=400, seed=i)
    with (src / "part-2.jsonl").open("a") as f:
        f.write("{not json\n")  # a bad line in a shard that is copied, not read again
    build_token_cache(src, tok_dir, cache_dir=tmp_path / "tokens", num_proc=2)
    synthetic_dataset(src / "part-1.jsonl", records=400, seed=9)
    again = build_token_cache(src, tok_dir, cache_dir=tmp_path / "tokens", num_proc=2)
    meta = json.loads((again.folder / "meta.json").read_text())
    assert again.status == "rebuilt: data changed"
    assert meta["build"]["bytes"] == (src / "part-1.jsonl").stat().st_size  # read: that one
    fresh = build_token_cache(src, tok_dir, cache_dir=tmp_path / "fresh", num_proc=1)
    assert _arrays(again.folder) == _arrays(fresh.folder)
    assert again.problems.to_dict("records") == fresh.problems.to_dict("records") == [
        {"line": "part-2.jsonl:401", "problem": "invalid_json",
         "detail": "column 2: Expecting property name enclosed in double quotes"}]
    (src / "part-0.jsonl").write_text((src / "part-0.jsonl").read_text() + "\n")  # changed
    with pytest.raises(ValueError, match=r"part-2.jsonl: line 401: invalid_json.*--on-error skip"):
        build_token_cache(src, tok_dir, cache_dir=tmp_path / "tokens", on_error="raise")
