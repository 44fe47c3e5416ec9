"""The one token cache: tokenize once, keep the tokens on disk, reuse them while nothing changed.

`build_token_cache` streams the records into DIAG_HOME/tokens/<key>/ (arrays, meta.json last),
keyed by content; a changed shard is tokenized alone, the others copied from an older cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diag.data.identity import FORMAT, file_identities, key_parts, sha256
from diag.data.records import (PROBLEM_COLUMNS, Chunk, check_on_error, plan_chunks, problem,
                               refusal, shard_files, stamps)
from diag.data.stream import Arrays, Job, encoded
from diag.data.text import load_tokenizer
from diag.files import atomic_folder, sweep_orphans

CHUNK_BYTES = 1 << 20  # JSONL bytes a worker reads and tokenizes at once (~25 MB of its memory)
MEMORY_CHUNK = 1000  # records per chunk of a source given as a list
PROBLEMS_KEPT = 1000  # records left out that meta.json lists (all of them are counted)
COPY_RECORDS = 100_000  # records of an unchanged shard copied from an older cache at once
TOKENS_PER_BYTE = 0.5  # the free-disk estimate's guess (docs/calibration.md, data)
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
    problems: Any  # the records left out (read_source's frame; the first PROBLEMS_KEPT)
    skipped: int = 0  # records left out (all of them, or those among the first `limit`)
    complete: bool = True  # False: the first records only (a `limit` build)


def read_meta(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The meta of a finished cache; None for a torn or foreign folder (arrays disagree)."""
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


def _finished(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    if not root.is_dir():
        return []
    return [(f, m) for f in root.iterdir() if not f.name.startswith(".")
            and (m := read_meta(f)) is not None]


def _serves(meta: dict[str, Any], records: int | None) -> bool:
    """A cache holds every record asked for: all of them, or at least the first `records`."""
    return meta["complete"] or (records is not None and meta["records"] >= records)


def _hit(found: tuple[Path, dict[str, Any]], on_error: str, start: float,
         limit: int | None) -> TokenCache:
    """The cache as asked for: with a limit, the problems met reading the first `limit` records."""
    import pandas as pd

    folder, meta = found
    whole = limit is None or limit >= meta["records"]  # such a read goes to the source's end
    rows = [p for p in meta["problems"] if whole or p["record"] < limit]
    problems = pd.DataFrame(rows, columns=PROBLEM_COLUMNS)
    if on_error == "raise" and not problems.empty:
        first = problems.iloc[0]
        where, _, number = str(first["line"]).rpartition(":")
        raise refusal(where or Path(meta["source"]).name, number, first["problem"],
                      first["detail"], where.endswith(".parquet"))
    return TokenCache(folder, meta["key"], meta["records"], meta["tokens"], "hit",
                      time.perf_counter() - start, problems,
                      meta["skipped"] if whole else len(rows), meta["complete"])


def build_token_cache(source: Source, tokenizer_dir: str | os.PathLike[str], *,
                      fields: dict[str, str] | None = None, cache_dir: Any = None,
                      num_proc: int | None = None, on_error: str = "skip", rebuild: bool = False,
                      limit: int | None = None, chunk_bytes: int = CHUNK_BYTES) -> TokenCache:
    """The token cache of source (a file, a folder of shards, or records), reused when its key
    matches; fields, on_error: read_source's; rebuild: every shard again; limit: the first ones."""
    from diag.config import diag_home
    from diag.machine.device import usable_cores

    for name, value in (("num_proc", num_proc), ("limit", limit), ("chunk_bytes", chunk_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name}={value!r}: must be a whole number >= 1 (or None)")
    check_on_error(on_error)
    start = time.perf_counter()
    root = Path(cache_dir) if cache_dir else diag_home() / "tokens"
    parts = key_parts(source, tokenizer_dir, fields, root)
    caches = _finished(root)
    serving = [(f, m) for f, m in caches if m["parts"] == parts and _serves(m, limit)]
    if serving and not rebuild:
        return _hit(serving[0], on_error, start, limit)
    key = sha256(json.dumps({**parts, "limit": limit}, sort_keys=True).encode())
    folder = root / key[:16]  # by content, not path: a landed copy hits the original's cache
    path = str(Path(source).resolve()) if isinstance(source, (str, os.PathLike)) else None
    stale = [f for f, m in caches if path and m["source"] == path and m["parts"] != parts]
    changed = " and ".join(k for k in parts if any(
        m["parts"][k] != parts[k] for f, m in caches if f in stale))
    status = ("rebuilt: asked to" if serving else "rebuilt: the old cache was incomplete"
              if folder.exists() else f"rebuilt: {changed} changed" if changed else "built")
    head = {"format": FORMAT, "key": key, "parts": parts, "limit": limit, "source": path,
            "tokenizer_dir": str(tokenizer_dir), "fields": dict(fields or {})}
    meta = _build(source, folder, head, num_proc or usable_cores(), chunk_bytes, on_error,
                  start, rebuild)
    for old, m in caches:  # replaced, or served by this one from now on: not kept
        if old in stale or (m["parts"] == parts and old != folder
                            and _serves(meta, None if m["complete"] else m["records"])):
            shutil.rmtree(old, ignore_errors=True)
    return dataclasses.replace(_hit((folder, meta), "skip", start, limit), status=status)


def _build(source: Source, folder: Path, head: dict[str, Any], procs: int, chunk_bytes: int,
           on_error: str, start: float, rebuild: bool = False) -> dict[str, Any]:
    """Stream source's tokens into atomic_folder(folder), meta.json last; returns that meta."""
    path, limit, root = head["source"], head["limit"], folder.parent
    tok = load_tokenizer(head["tokenizer_dir"], head["parts"]["tokenizer"])
    dtype = "uint16" if len(tok) <= 1 << 16 else "uint32"  # the smallest that holds every id
    job = Job(head["tokenizer_dir"], head["parts"]["tokenizer"], dtype, head["fields"])
    ids: dict[str, str] = {}
    if path:  # each shard an older cache of this tokenizer and settings holds: copied, not
        files = shard_files(source)  # tokenized again
        ids = {str(f.relative_to(source)) if len(files) > 1 else f.name: i
               for f, i in zip(files, file_identities(source, root))}
        chunks = _with_copies(plan_chunks(source, head["fields"], chunk_bytes), ids,
                              {} if rebuild else _reused(root, head["parts"]))
    else:
        chunks = iter([Chunk("records", None, rows=tuple(source[i:i + MEMORY_CHUNK]))
                       for i in range(0, len(source), MEMORY_CHUNK)])
    root.mkdir(parents=True, exist_ok=True)
    sweep_orphans(root)  # what builds killed mid-way left behind
    before = stamps(source) if path else None
    if limit is None and before is not None:  # refused before any work: the free disk's estimate
        size = sum(s[1] for s in before)
        need = int(size * TOKENS_PER_BYTE * (np.dtype(dtype).itemsize + 1))  # ids + mask byte
        if need > (free := shutil.disk_usage(root).free):
            raise RuntimeError(f"token cache: {size / 1e9:.3g} GB of records needs about "
                               f"{need / 1e9:.3g} GB at {root}, {free / 1e9:.3g} GB is free; free "
                               "space or point DIAG_HOME at a larger disk")
    try:
        with atomic_folder(folder) as tmp:  # swapped in whole, after every byte is on disk
            built = _write(tmp, chunks, job, procs, limit, on_error, ids)
            if not built["records"]:
                raise ValueError(f"--source: {Path(path).name if path else 'records'} holds no "
                                 f"usable records ({built['skipped']} that do not fit): nothing "
                                 "to tokenize")
            if before is not None and (changed := _changed(before)):
                raise ValueError(f"--source: {changed} while its token cache was built; "
                                 "nothing was kept: build again once it is written")
            seconds = time.perf_counter() - start
            meta = {**head, **built, "vocab_size": len(tok), "eos": tok.eos_token_id,
                    "pad_token_id": tok.pad_token_id}
            meta["build"].update(seconds=seconds, tokens_per_s=built["tokens"] / seconds,
                                 mb_per_s=built["build"]["bytes"] / seconds / 1e6)
            # last: a folder without it (or with a mismatched one) is never read as a cache
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    except OSError as err:
        refused = _refusal_of(err, root, path)
        if refused is None:
            raise
        raise refused from None
    return meta


def _reused(root: Path, parts: dict[str, str]) -> dict[str, tuple[Path, str, dict[str, Any]]]:
    """{shard identity: (cache folder, dtype, entry)}: whole shards in caches of these settings."""
    got: dict[str, tuple[Path, str, dict[str, Any]]] = {}
    for folder, meta in _finished(root):
        if [meta["parts"][k] for k in ("tokenizer", "settings")] == [parts["tokenizer"],
                                                                        parts["settings"]]:
            for e in meta.get("shards", ()):
                if e["complete"]:
                    got.setdefault(e["identity"], (folder, meta["dtype"], e))
    return got


def _with_copies(chunks: Any, ids: dict[str, str], reused: dict[str, Any]) -> Any:
    """The chunks, each shard held in `reused` replaced by copy chunks of its records."""
    done = set()
    for chunk in chunks:
        hit = reused.get(ids.get(chunk.where, ""))
        if hit is None:
            yield chunk
            continue
        if chunk.where in done:
            continue
        done.add(chunk.where)
        folder, dtype, e = hit
        first, end = e["first"], e["first"] + e["records"]
        for a in range(first, max(end, first + 1), COPY_RECORDS):
            b, last = min(a + COPY_RECORDS, end), a + COPY_RECORDS >= end
            problems = [(p[0] - a + first, *p[1:]) for p in e["problems"]
                        if a - first <= p[0] and (last or p[0] < b - first)]
            yield Chunk(chunk.where, chunk.path, shard=chunk.shard,
                        copy=(str(folder), dtype, a, b, e["lines"] if last else 0, problems))


def _write(tmp: Path, chunks: Any, job: Job, procs: int, limit: int | None,
           on_error: str, ids: dict[str, str]) -> dict[str, Any]:
    """Every chunk's arrays into tmp, in order; meta.json's account of them, shard by shard."""
    arrays = Arrays(tmp, job.dtype)
    shards: dict[str, dict[str, Any]] = {}
    problems: list[dict[str, Any]] = []
    skipped = read = 0
    lines: dict[str, int] = {}  # lines of each file so far: a chunk numbers its own from 1
    full = False
    try:
        remaining = (lambda: None) if limit is None else (lambda: limit - arrays.records)
        with contextlib.closing(encoded(chunks, job, procs, remaining)) as parts:
            for chunk, part in parts:  # closed on the way out: a pool's workers stop at once
                if limit is not None and arrays.records + len(part.lengths) >= limit:
                    part, full = part.first(limit - arrays.records), True
                base = lines.get(chunk.where, 0)
                shard = shards.setdefault(chunk.where, {
                    "where": chunk.where, "identity": ids.get(chunk.where, ""),
                    "first": arrays.records, "records": 0, "problems": []})
                for before, number, *got in part.problems:
                    shard["problems"].append((arrays.records + before - shard["first"],
                                              base + number, *got))
                    row = problem(chunk, base + number, tuple(got), on_error)  # "raise": refused
                    skipped += 1
                    if len(problems) < PROBLEMS_KEPT:  # and the good records read before it
                        problems.append({**row, "record": arrays.records + before})
                lines[chunk.where] = shard["lines"] = base + part.lines
                arrays.append(part)
                shard["records"] += len(part.lengths)
                read += chunk.size
                if full:
                    break
        arrays.finish()
    finally:
        arrays.close()
    for i, shard in enumerate(shards.values()):  # a limit build's last shard is not whole
        shard["complete"] = not full or i < len(shards) - 1
    return {"records": arrays.records, "tokens": arrays.tokens, "dtype": job.dtype,
            "complete": not full, "problems": problems, "skipped": skipped,
            "shards": list(shards.values()),
            "build": {"bytes": read, "processes": procs}}


def _changed(before: list[tuple[str, int, int]]) -> str:
    """What happened to the source's files since `before`: "" where nothing did."""
    for name, size, mtime in before:
        try:
            st = os.stat(name)
        except FileNotFoundError:
            return f"{name} disappeared"
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            return f"{name} changed"
    return ""


def _refusal_of(err: OSError, root: Path, path: str | None) -> Exception | None:
    """One line for a build that ran out of room, or lost its source; None for other errors."""
    if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return RuntimeError(f"token cache: writing under {root} failed ({err.strerror}); nothing "
                            "was kept: free space (or raise the file-size limit) or point "
                            "DIAG_HOME at a larger disk")
    if isinstance(err, FileNotFoundError) and path and err.filename \
            and str(Path(err.filename).resolve()).startswith(path):
        return ValueError(f"--source: {err.filename} disappeared while its token cache was "
                          "built; nothing was kept: build again once it is written")
    return None
