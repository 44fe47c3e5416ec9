"""The one token cache: tokenize once, keep the tokens on disk, reuse them while nothing changed.

`build_token_cache` streams the records into DIAG_HOME/tokens/<key>/ (arrays, meta.json last),
keyed by each shard's identity, the tokenizer's and the settings; a changed shard is tokenized
alone, the others copied from an older cache.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diag.config import diag_home
from diag.config.base import whole
from diag.config.source import MANIFEST_SUFFIX
from diag.data.records import (PROBLEM_COLUMNS, Chunk, check_on_error, plan_chunks, refusal,
                               shard_files)
from diag.data.stream import Job, with_copies, write_chunks
from diag.data.text import PROMPT_TEMPLATE, PROMPT_TEMPLATE_NO_INPUT, load_tokenizer
from diag.files import atomic_file, atomic_folder, file_sha256, sweep_orphans

FORMAT = 4  # bump when the arrays' layout or the encoding changes: every old cache goes stale
# what a tokenizer is saved as; transformers 5 writes the chat template to its own file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
MEMO = ".identities.json"  # {path: [size, mtime_ns, ctime_ns, inode, identity]} under the caches
CHUNK_BYTES = 1 << 20  # JSONL bytes a worker reads and tokenizes at once (~25 MB of its memory)
MEMORY_CHUNK = 1000  # records per chunk of a source given as a list
TOKENS_PER_BYTE = 0.5  # the free-disk estimate's guess (docs/calibration.md, data)
Source = str | os.PathLike[str] | list[dict[str, Any]]
Identities = dict[Path, tuple[list[int], str]]  # {shard: ([size, mtime_ns, ctime_ns, inode], id)}


@dataclass(frozen=True)
class TokenCache:
    folder: Path
    key: str
    records: int
    tokens: int
    status: str  # "hit", "built", or "rebuilt: <what changed>"
    seconds: float  # to check (hit) or to build it
    problems: Any  # the records left out (read_source's frame; the first PROBLEMS_KEPT)
    skipped: int = 0  # records left out (all of them, or those among the first `limit`)
    complete: bool = True  # False: the first records only (a `limit` build)


def file_identities(source: str | os.PathLike[str], memo_dir: Path) -> Identities:
    """Each shard's stamp and identity: the landing manifest's, else a sha256 memoized by stat."""
    root, found, hashed, memo_path = Path(source), {}, False, memo_dir / MEMO
    manifest = root.with_name(root.name + MANIFEST_SUFFIX)  # land()'s: {file under root: ...}
    try:
        written, got = manifest.stat().st_mtime_ns, json.loads(manifest.read_text())
        prefix = got["url"].split("/", 3)[3] if got["url"].count("/") >= 3 else ""
        landed = {obj["key"][len(prefix):].strip("/") if root.is_dir() else "": (
            obj["size"], written, f"landed:{obj['etag']}:{obj.get('digest') or obj.get('sha256')}:"
            f"{obj['size']}") for obj in got["objects"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        landed = {}  # none, or not one this diag wrote: the files are hashed instead
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    for file in shard_files(root):
        st = file.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        known = landed.get(file.relative_to(root).as_posix() if root.is_dir() else "")
        if known is not None and known[0] == st.st_size and st.st_mtime_ns <= known[1]:
            found[file] = stamp, known[2]  # landed and untouched since its manifest was written
            continue
        old = memo.get(str(file.resolve()))
        if old is None or old[:4] != stamp:
            old = memo[str(file.resolve())] = [*stamp, "sha256:" + file_sha256(file)]
            hashed = True
        found[file] = stamp, old[4]
    if hashed:  # written whole: a lost race costs one more hash
        with atomic_file(memo_path) as tmp:  # files gone (a run's copies) are forgotten
            tmp.write_text(json.dumps({k: v for k, v in memo.items() if os.path.exists(k)}))
    return found


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def key_parts(source: Source, tokenizer_dir: str | os.PathLike[str], fields: dict[str, str],
              ids: Identities) -> dict[str, str]:
    """Digests of what the tokens depend on: data (ids: its shards'), tokenizer, settings."""
    if not isinstance(source, (str, os.PathLike)):
        data = sha256(json.dumps(list(source), sort_keys=True))
    elif not Path(source).is_dir():
        data = next(iter(ids.values()))[1]
    else:  # a folder: each shard's name under it and identity, in order
        data = sha256("\n".join(f"{f.relative_to(source).as_posix()}={i}"
                                for f, (_, i) in ids.items()))
    tok = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(tokenizer_dir, name)
        if path.is_file():
            tok.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    settings = json.dumps({"format": FORMAT, "template": PROMPT_TEMPLATE,
                           "template_no_input": PROMPT_TEMPLATE_NO_INPUT,
                           "fields": dict(sorted(fields.items()))})
    return {"data": data, "tokenizer": tok.hexdigest(), "settings": sha256(settings)}


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
    said = [meta.get(k) for k in ("format", "tokens", "tokens", "records")]
    return meta if said == [FORMAT, ids, mask, records] else None


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
    """source's token cache (a file, shards or records), reused by key; limit: the first ones."""
    from diag.machine.device import usable_cores  # its GPU probe: not at import

    for name, value in (("num_proc", num_proc), ("limit", limit), ("chunk_bytes", chunk_bytes)):
        if value is not None and not (whole(value) and value >= 1):
            raise ValueError(f"{name}={value!r}: must be a whole number >= 1 (or None)")
    check_on_error(on_error)
    start = time.perf_counter()
    root = Path(cache_dir) if cache_dir else diag_home() / "tokens"
    path = str(Path(source).resolve()) if isinstance(source, (str, os.PathLike)) else None
    ids = file_identities(source, root) if path else {}
    parts = key_parts(source, tokenizer_dir, dict(fields or {}), ids)
    caches = [(f, m) for f in (root.iterdir() if root.is_dir() else ())  # the finished ones
              if not f.name.startswith(".") and (m := read_meta(f)) is not None]
    serving = [(f, m) for f, m in caches if m["parts"] == parts and _serves(m, limit)]
    if serving and not rebuild:
        return _hit(serving[0], on_error, start, limit)
    key = sha256(json.dumps({**parts, "limit": limit}, sort_keys=True))
    folder = root / key[:16]  # by content, not path: a landed copy hits the original's cache
    stale = [f for f, m in caches if path and m["source"] == path and m["parts"] != parts]
    changed = " and ".join(k for k in parts if any(
        m["parts"][k] != parts[k] for f, m in caches if f in stale))
    status = ("rebuilt: asked to" if serving else "rebuilt: the old cache was incomplete"
              if folder.exists() else f"rebuilt: {changed} changed" if changed else "built")
    head = {"format": FORMAT, "key": key, "parts": parts, "limit": limit, "source": path,
            "tokenizer_dir": str(tokenizer_dir), "fields": dict(fields or {})}
    # {shard identity: where it is}: whole shards in caches of these settings (the first wins)
    reused = {e["identity"]: (old, m["dtype"], e) for old, m in reversed([] if rebuild else caches)
              if all(m["parts"][k] == parts[k] for k in ("tokenizer", "settings"))
              for e in reversed(m.get("shards", ())) if e["complete"]}
    meta = _build(source, folder, head, num_proc or usable_cores(), chunk_bytes, on_error,
                  start, ids, reused)
    for old, m in caches:  # replaced, or served by this one from now on: not kept
        if old in stale or (m["parts"] == parts and old != folder
                            and _serves(meta, None if m["complete"] else m["records"])):
            shutil.rmtree(old, ignore_errors=True)
    return dataclasses.replace(_hit((folder, meta), "skip", start, limit), status=status)


def _build(source: Source, folder: Path, head: dict[str, Any], procs: int, chunk_bytes: int,
           on_error: str, start: float, ids: Identities, reused: dict[str, Any]
           ) -> dict[str, Any]:
    """Stream source's tokens into atomic_folder(folder), meta.json last; returns that meta."""
    path, limit, root = head["source"], head["limit"], folder.parent
    tok = load_tokenizer(head["tokenizer_dir"], head["parts"]["tokenizer"])
    dtype = "uint16" if len(tok) <= 1 << 16 else "uint32"  # the smallest that holds every id
    job = Job(head["tokenizer_dir"], head["parts"]["tokenizer"], dtype, head["fields"])
    if path:  # each shard an older cache of these settings holds: copied, not tokenized again
        chunks = with_copies(plan_chunks(source, head["fields"], chunk_bytes), ids, reused)
    else:
        chunks = iter([Chunk("records", None, rows=tuple(source[i:i + MEMORY_CHUNK]))
                       for i in range(0, len(source), MEMORY_CHUNK)])
    root.mkdir(parents=True, exist_ok=True)
    sweep_orphans(root)  # what builds killed mid-way left behind
    if limit is None and path:  # refused before any work: the free disk's estimate
        size = sum(stamp[0] for stamp, _ in ids.values())
        need = int(size * TOKENS_PER_BYTE * (np.dtype(dtype).itemsize + 1))  # ids + mask byte
        if need > (free := shutil.disk_usage(root).free):
            raise RuntimeError(f"token cache: {size / 1e9:.3g} GB of records needs about "
                               f"{need / 1e9:.3g} GB at {root}, {free / 1e9:.3g} GB is free; free "
                               "space or point DIAG_HOME at a larger disk")
    try:
        with atomic_folder(folder) as tmp:  # swapped in whole, after every byte is on disk
            built = write_chunks(tmp, chunks, job, procs, limit, on_error, ids)
            if not built["records"]:
                raise ValueError(f"--source: {Path(path).name if path else 'records'} holds no "
                                 f"usable records ({built['skipped']} that do not fit): nothing "
                                 "to tokenize")
            for file, (stamp, _) in ids.items():  # gone (FileNotFoundError) or changed: refused
                if [(st := file.stat()).st_size, st.st_mtime_ns] != stamp[:2]:
                    raise _lost(f"{file} changed")
            seconds = time.perf_counter() - start
            meta = {**head, **built, "vocab_size": len(tok), "eos": tok.eos_token_id,
                    "pad_token_id": tok.pad_token_id}
            meta["build"].update(seconds=seconds, tokens_per_s=built["tokens"] / seconds,
                                 mb_per_s=built["build"]["bytes"] / seconds / 1e6)
            # last: a folder without it (or with a mismatched one) is never read as a cache
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    except OSError as err:  # out of room, or the source lost: one line
        if err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise RuntimeError(f"token cache: writing under {root} failed ({err.strerror}); "
                               "nothing was kept: free space (or raise the file-size limit) or "
                               "point DIAG_HOME at a larger disk") from None
        if isinstance(err, FileNotFoundError) and path and err.filename \
                and str(Path(err.filename).resolve()).startswith(path):
            raise _lost(f"{err.filename} disappeared") from None
        raise
    return meta


def _lost(what: str) -> ValueError:
    return ValueError(f"--source: {what} while its token cache was built; nothing was kept: "
                      "build again once it is written")
