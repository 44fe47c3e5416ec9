"""A source rewritten in place at the same size is new data: the token cache is rebuilt, never
served with the old tokens, whether its identity came from a landing manifest or a hash memo;
a landed file untouched since its manifest is still a hit."""

from __future__ import annotations

import json
import os

import pytest

from diag.data import build_token_cache, read_meta

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok_dir() -> str:
    from diag.embedded import ensure_assets

    return str(ensure_assets().model_dir)


def _records(path, answer: str) -> None:
    path.write_text("".join(json.dumps({"instruction": f"Sort {i}.", "input": "pear apple",
                                        "output": answer}) + "\n" for i in range(12)))


def _land(path) -> os.stat_result:
    """A manifest as diag.storage.land writes it beside what it landed (after the file)."""
    manifest = path.with_name(path.name + ".diag-manifest.json")
    manifest.write_text(json.dumps({"url": f"s3://b/{path.name}", "objects": [
        {"key": path.name, "size": path.stat().st_size, "etag": "e1", "digest": "crc32:AAAA"}]}))
    return manifest.stat()


def _tokens(cache) -> bytes:
    return (cache.folder / "train.bin").read_bytes()


def test_a_landed_file_rewritten_at_the_same_size_is_rebuilt(tok_dir, tmp_path):
    data, root = tmp_path / "d.jsonl", tmp_path / "tokens"
    _records(data, "apple pear")
    size, written = data.stat().st_size, _land(data)
    os.utime(data, ns=(written.st_mtime_ns, written.st_mtime_ns))  # landed as it was recorded
    built = build_token_cache(data, tok_dir, cache_dir=root)
    first = _tokens(built)
    # untouched since its manifest (written in the same clock tick): its ETag is its identity,
    # the file is not read to hash it
    assert read_meta(built.folder)["parts"]["data"] == f"landed:e1:crc32:AAAA:{size}"
    assert build_token_cache(data, tok_dir, cache_dir=root).status == "hit"
    _records(data, "pear apple")  # the same bytes' count, other tokens
    later = written.st_mtime_ns + 10**9
    os.utime(data, ns=(later, later))
    assert data.stat().st_size == size
    again = build_token_cache(data, tok_dir, cache_dir=root)
    assert again.status == "rebuilt: data changed" and _tokens(again) != first


def test_a_file_rewritten_at_the_same_size_and_mtime_is_rehashed(tok_dir, tmp_path):
    # no manifest: a memo of hashed files; a copy that keeps the old mtime (cp -p, rsync -t)
    # still changes the file's ctime, so it is hashed again
    data, root = tmp_path / "d.jsonl", tmp_path / "tokens"
    _records(data, "apple pear")
    first = _tokens(build_token_cache(data, tok_dir, cache_dir=root))
    st = data.stat()
    _records(data, "pear apple")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    again = build_token_cache(data, tok_dir, cache_dir=root)
    assert again.status == "rebuilt: data changed" and _tokens(again) != first


def test_an_older_file_moved_over_a_landed_one_is_rebuilt(tok_dir, tmp_path):
    # `mv` keeps the older file's mtime, under the manifest's: its other size gives it away
    data, root = tmp_path / "d.jsonl", tmp_path / "tokens"
    _records(data, "apple pear")
    written = _land(data)
    first = _tokens(build_token_cache(data, tok_dir, cache_dir=root))
    older = tmp_path / "older.jsonl"
    _records(older, "apple, pear")
    before = written.st_mtime_ns - 10**9
    os.utime(older, ns=(before, before))
    older.replace(data)
    again = build_token_cache(data, tok_dir, cache_dir=root)
    assert again.status == "rebuilt: data changed" and _tokens(again) != first
