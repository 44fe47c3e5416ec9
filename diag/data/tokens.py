"""The one token cache: tokenize once, keep the tokens on disk, reuse them while nothing changed.

`build_token_cache(source, tokenizer_dir)` reads the records (diag.data.records), tokenizes them
(batched, in `num_proc` forked processes when asked) and keeps three arrays under
DIAG_HOME/tokens/<key>/: train.bin (every record's ids end to end, EOS closing each: nanoGPT's flat
file, uint16 when the vocabulary fits), loss_mask.npy and offsets.npy. The key digests the data,
the tokenizer files and the settings (FORMAT, templates, fields), not the path: the loader sweep,
the accum sweep and the QLoRA job share one folder for the same data and tokenizer. A build is
written beside it and swapped in whole, meta.json last: an interrupted build is never taken.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diag.data.records import PROBLEM_COLUMNS, read_source, refusal, render_chat, shard_files
from diag.data.text import PROMPT_TEMPLATE, PROMPT_TEMPLATE_NO_INPUT, encode_batch, load_tokenizer
from diag.files import file_sha256, swap_in

FORMAT = 2  # bump when the arrays' layout or the encoding changes: every old cache goes stale
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_CHUNK = 1000  # records per batched tokenizer call: large enough to amortize the Python wrapper
ARRAYS = ("train.bin", "loss_mask.npy", "offsets.npy")  # a cache's data files, beside meta.json

Source = str | os.PathLike[str] | list[dict[str, Any]]


@dataclass(frozen=True)
class TokenCache:
    """A finished token cache: where it is, its key, what it holds, how it was had."""

    folder: Path
    key: str
    records: int
    tokens: int
    status: str  # "hit", "built", or "rebuilt: <what changed>"
    seconds: float  # to check (hit) or to build it
    problems: Any  # the records left out (read_source's problems frame)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id: uint16 up to 65,536 ids (GPT-2's 50,257)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size}: must be > 0")
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_parts(source: Source, tokenizer_dir: str | os.PathLike[str],
              fields: dict[str, str] | None = None) -> dict[str, str]:
    """The three things the tokens depend on, each as a digest: data, tokenizer, settings."""
    if isinstance(source, (str, os.PathLike)):
        files = shard_files(source)
        if Path(source).is_file():
            data = file_sha256(source)
        else:  # a folder of shards: each shard's name and bytes, in reading order
            data = _sha256("\n".join(f"{f.relative_to(source)}={file_sha256(f)}"
                                     for f in files).encode())
    else:
        data = _sha256(json.dumps(list(source), sort_keys=True).encode())
    tok = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(tokenizer_dir, name)
        if path.is_file():
            tok.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    settings = json.dumps({"format": FORMAT, "template": PROMPT_TEMPLATE,
                           "template_no_input": PROMPT_TEMPLATE_NO_INPUT,
                           "fields": dict(sorted((fields or {}).items()))})
    return {"data": data, "tokenizer": tok.hexdigest(), "settings": _sha256(settings.encode())}


def _encode_chunk(args: tuple[str, str, list[dict[str, str]]]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokenizer_dir, version, records = args
    ids, prompt_lens = encode_batch(load_tokenizer(tokenizer_dir, version), records)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    mask = np.ones(len(flat), dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    for start, n in zip(starts, prompt_lens):  # prompt tokens carry no loss
        mask[start:start + n] = 0
    return flat, mask, lengths


# Not Hugging Face `datasets`: its map(batched=True) with the same tokenizer, measured here on the
# embedded 30,318 records (2 loaded cores, medians of 3), took 8.8 s (num_proc=1) and 8.9 s
# (num_proc=2) against 5.6 s and 4.8 s for tokenize() below; its fingerprint-cache hit (0.02 s)
# matches this cache's; it adds pyarrow and a 3.2 s import. The arrays below are what it would
# store, without the Arrow layer between them and the DataLoader.
def tokenize(records: list[dict[str, str]], tokenizer_dir: str, num_proc: int = 1,
             version: str = "") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, loss_mask, offsets) of every record, in order; num_proc > 1 forks that many."""
    chunks = [(tokenizer_dir, version, records[i:i + _CHUNK])
              for i in range(0, len(records), _CHUNK)]
    if num_proc > 1 and len(chunks) > 1:
        import multiprocessing

        # fork: the children inherit the records instead of receiving them pickled
        with multiprocessing.get_context("fork").Pool(min(num_proc, len(chunks))) as pool:
            parts = pool.map(_encode_chunk, chunks)
    else:
        parts = [_encode_chunk(c) for c in chunks]
    if not parts:
        return np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64)
    lengths = np.concatenate([p[2] for p in parts])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), offsets)


def read_meta(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The meta of a finished cache, or None where meta.json is missing or the arrays disagree
    with it (a torn or foreign folder: never read as a cache)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        ids = (folder / "train.bin").stat().st_size / np.dtype(meta["dtype"]).itemsize
        mask = np.load(folder / "loss_mask.npy", mmap_mode="r").shape[0]
        records = np.load(folder / "offsets.npy", mmap_mode="r").shape[0] - 1
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if meta.get("format") != FORMAT or [ids, mask] != [meta.get("tokens")] * 2 \
            or records != meta.get("records"):
        return None
    return meta


def _earlier(root: Path, source: Source, parts: dict[str, str], key: str
             ) -> tuple[list[Path], str]:
    """Finished caches of the same source path under another key, and what changed since."""
    if not isinstance(source, (str, os.PathLike)) or not root.is_dir():
        return [], ""
    path, found, changed = str(Path(source).resolve()), [], set()
    for folder in root.iterdir():
        meta = read_meta(folder) if not folder.name.startswith(".") else None
        if meta is not None and meta.get("source") == path and meta.get("key") != key:
            found.append(folder)
            changed |= {k for k, v in parts.items() if meta["parts"].get(k) != v}
    return found, " and ".join(k for k in parts if k in changed)


def _drop_orphans(root: Path) -> None:
    """Remove the temporary folders of builds whose process is gone (killed mid-build)."""
    for tmp in root.glob(".*.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-")[0]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue  # not ours to judge: another user's live process, or a foreign name


def _refuse(source: Source, problems: Any) -> ValueError:
    """on_error="raise" on data with problems: the first one, as read_source names it."""
    first = problems.iloc[0]
    where, _, number = str(first["line"]).rpartition(":")
    where = where or Path(source).name  # type: ignore[arg-type]  # only a path has problems
    return refusal(where, number, first["problem"], first["detail"], where.endswith(".parquet"))


def build_token_cache(source: Source, tokenizer_dir: str | os.PathLike[str], *,
                      fields: dict[str, str] | None = None,
                      cache_dir: str | os.PathLike[str] | None = None, num_proc: int = 1,
                      on_error: str = "skip", rebuild: bool = False) -> TokenCache:
    """The token cache of source (a JSONL/Parquet file, a folder of shards, or a list of
    records), reused when its key matches.

    fields: the record fields (diag.data.read_source's; None = Alpaca). on_error: "skip" leaves
    records that do not fit out (listed in `problems`; the cache always holds the rest), "raise"
    refuses data with any. rebuild=True ignores a matching cache. num_proc: tokenizing processes.
    """
    import pandas as pd

    from diag.config import ON_ERROR, diag_home

    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc={num_proc!r}: must be a whole number >= 1")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}: allowed values are "
                         + ", ".join(map(repr, ON_ERROR)))
    start = time.perf_counter()
    tokenizer_dir = str(tokenizer_dir)
    parts = key_parts(source, tokenizer_dir, fields)
    key = _sha256(json.dumps(parts, sort_keys=True).encode())
    root = Path(cache_dir) if cache_dir else diag_home() / "tokens"
    folder = root / key[:16]  # by content, not path: a landed copy hits the original's cache
    meta = read_meta(folder)
    if meta is not None and meta.get("key") == key and not rebuild:
        problems = pd.DataFrame(meta["problems"], columns=PROBLEM_COLUMNS)
        if on_error == "raise" and not problems.empty:
            raise _refuse(source, problems)
        return TokenCache(folder, key, meta["records"], meta["tokens"], "hit",
                          time.perf_counter() - start, problems)
    earlier, changed = _earlier(root, source, parts, key)
    if folder.exists():
        status = "rebuilt: asked to" if meta is not None else \
            "rebuilt: the old cache was incomplete"
    else:
        status = f"rebuilt: {changed} changed" if changed else "built"
    if isinstance(source, (str, os.PathLike)):
        records, problems = read_source(source, fields, on_error="skip")
        if on_error == "raise" and not problems.empty:
            raise _refuse(source, problems)
    else:
        records, problems = list(source), pd.DataFrame(columns=PROBLEM_COLUMNS)
    version = parts["tokenizer"]  # a tokenizer saved again since this process loaded it is reloaded
    tok = load_tokenizer(tokenizer_dir, version)
    records = render_chat(records, tok)  # chat records: through the tokenizer's chat template
    ids, mask, offsets = tokenize(records, tokenizer_dir, num_proc, version)
    dtype = token_dtype(len(tok))
    root.mkdir(parents=True, exist_ok=True)
    _drop_orphans(root)
    tmp = root / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, write in (("train.bin", ids.astype(dtype).tofile),
                            ("loss_mask.npy", lambda f: np.save(f, mask)),
                            ("offsets.npy", lambda f: np.save(f, offsets))):
            with open(tmp / name, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        meta = {"format": FORMAT, "key": key, "parts": parts, "records": len(records),
                "tokens": int(len(ids)), "dtype": dtype.name, "vocab_size": len(tok),
                "eos": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                "tokenizer_dir": tokenizer_dir, "fields": fields or {},
                "source": str(Path(source).resolve()) if isinstance(source, (str, os.PathLike))
                else None, "problems": problems.to_dict("records")}
        write_meta(tmp, meta)
        swap_in(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in earlier:  # the same source's stale caches: replaced, not kept beside it
        shutil.rmtree(old, ignore_errors=True)
    return TokenCache(folder, key, len(records), int(len(ids)), status,
                      time.perf_counter() - start, problems)


def write_meta(tmp: Path, meta: dict[str, Any]) -> None:
    """Written last: a folder without it (or with a mismatched one) is never read as a cache."""
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
