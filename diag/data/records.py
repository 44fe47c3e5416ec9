"""The user's records as they are: JSONL (plain, .gz, .zst) and Parquet, a file or shards, read
chunk by chunk (`plan_chunks`, `split_chunk`: whole JSONL lines, Parquet row groups). A record
becomes Alpaca's, {"prompt", "response"} or {"messages"}; one that does not fit is refused, or
listed ("skip").
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from diag.config.base import ON_ERROR
from diag.config.source import COMPRESSED, record_files

PROBLEM_COLUMNS = ["line", "problem", "detail"]  # one row per record left out
ALPACA_FIELDS = ("instruction", "input", "output")
_NOT_EMPTY = ("instruction", "output", "text", "response")  # the fields an empty text refuses


def shard_files(path: str | os.PathLike[str]) -> list[Path]:
    """The record files at path: the file, or a folder's data files (sorted, recursively)."""
    path = Path(path)
    return [path] if path.is_file() else record_files(
        sorted(p for p in path.rglob("*") if p.is_file()), path, lambda p: p.name)


@dataclass(frozen=True)
class Chunk:
    """What one process reads alone: JSONL lines, a Parquet row group, records, a cache's part."""

    where: str  # how a problem names the file: its name, or its path under the source folder
    path: Path | None
    start: int = 0
    stop: int = 0
    shard: bool = False  # one of a folder's files: problems are numbered "<where>:<line>"
    rows: tuple[dict[str, Any], ...] = ()
    size: int = 0  # bytes of the source it covers (a row group: its share of the file)
    data: bytes | None = None  # whole lines of a compressed file, decompressed
    copy: tuple[Any, ...] | None = None  # a cache's (folder, dtype, first, end, lines, problems)


def plan_chunks(path: str | os.PathLike[str], fields: dict[str, str] | None = None,
                chunk_bytes: int = 1 << 20, first_bytes: int = 64 << 10) -> Iterator[Chunk]:
    """The chunks of a file or folder of shards in order, Parquet shards checked first."""
    files = shard_files(path)
    wheres = {f: str(f.relative_to(path)) if len(files) > 1 else f.name for f in files}
    fields = dict(fields or {})
    wanted = list(fields.values()) or list(ALPACA_FIELDS)
    groups: dict[Path, list[int]] = {}  # a Parquet shard's bytes per row group
    types: dict[str, tuple[Any, Path]] = {}  # column: (its type, the shard that first had it)
    for file in (f for f in files if f.suffix == ".parquet"):  # footers: refused before any work
        import pyarrow.parquet as pq

        try:
            meta = pq.read_metadata(file)
        except Exception as err:  # noqa: BLE001  pyarrow's errors have no common base
            raise ValueError(f"--source: {wheres[file]} is not a readable Parquet file "
                             f"({type(err).__name__}: {err})") from None
        schema = meta.schema.to_arrow_schema()
        if missing := [c for c in wanted if c not in schema.names
                       and not (c == "input" and not fields)]:
            raise ValueError(_no_field(missing[0], fields, "column", f" in {wheres[file]}",
                                       schema.names))
        groups[file] = [file.stat().st_size * meta.row_group(g).num_rows // max(meta.num_rows, 1)
                        for g in range(meta.num_row_groups)]
        for column in (c for c in wanted if c in schema.names):
            got = schema.field(column).type
            want, first = types.setdefault(column, (got, file))
            if got != want:
                raise ValueError(f"--source: {wheres[file]}: column {column!r} is {got}, "
                                 f"{wheres[first]}'s is {want}: the shards' schemas differ; "
                                 "write them with one schema")
    return _chunks(files, wheres, groups, chunk_bytes, first_bytes)


def _chunks(files: list[Path], wheres: dict[Path, str], groups: dict[Path, list[int]],
            chunk_bytes: int, first_bytes: int) -> Iterator[Chunk]:
    shard = len(files) > 1
    for file in files:
        if file in groups:
            yield from (Chunk(wheres[file], file, g, g + 1, shard, size=size)
                        for g, size in enumerate(groups[file]))
            continue
        step = min(first_bytes, chunk_bytes)
        if file.suffix in COMPRESSED:  # no byte ranges: decompressed here, whole lines
            with open_records(file) as f:
                while lines := f.readlines(step):
                    data, step = b"".join(lines), min(step * 2, chunk_bytes)
                    yield Chunk(wheres[file], file, shard=shard, size=len(data), data=data)
            continue
        size, pos = file.stat().st_size, 0
        with open(file, "rb") as f:
            while pos < size:
                f.seek(min(pos + step, size))
                f.readline()  # to the end of the line the cut falls in: chunks hold whole lines
                yield Chunk(wheres[file], file, pos, f.tell(), shard, size=f.tell() - pos)
                pos, step = f.tell(), min(step * 2, chunk_bytes)


def open_records(path: str | os.PathLike[str], raw: Any = None) -> Any:
    """A record file's bytes (raw: opened already), decompressed where its name says (.gz, .zst)."""
    import pyarrow as pa

    codec = pa.Codec.detect(str(path)).name if Path(path).suffix in COMPRESSED else None
    return io.BufferedReader(pa.input_stream(str(path) if raw is None else raw, compression=codec))


def count_records(source: str | os.PathLike[str], at_most: int | None = None) -> int:
    """About the records at source, unparsed (Parquet footers' rows, JSONL lines), up to at_most."""
    total = 0
    for path in shard_files(source):
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            total += pq.read_metadata(path).num_rows
        else:
            with open_records(path) as f:  # a .jsonl.gz / .zst: its lines, decompressed
                last = b"\n"
                while (block := f.read(16 << 20)) and (at_most is None or total < at_most):
                    total, last = total + block.count(b"\n"), block[-1:]
            total += last != b"\n"  # a last line without its newline
        if at_most is not None and total >= at_most:
            return at_most
    return total


def split_chunk(chunk: Chunk, fields: dict[str, str] | None = None, stop_after: int | None = None
                ) -> tuple[int, list[dict[str, Any]], list[tuple[Any, ...]]]:
    """(lines, good records up to stop_after, problems as (good before, line, problem, detail))."""
    fields = dict(fields or {})
    if chunk.path is None:
        count, rows = len(chunk.rows), enumerate(chunk.rows, start=1)
    elif chunk.path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(chunk.path)
        columns = [c for c in list(fields.values()) or list(ALPACA_FIELDS)
                   if c in pf.schema_arrow.names]
        pad = {} if fields or "input" in columns else {"input": ""}  # Alpaca's optional input
        records = (({**pad, **row}) for batch in pf.iter_batches(
            batch_size=1024, row_groups=[chunk.start], columns=columns)
            for row in batch.to_pylist())
        count = pf.metadata.row_group(chunk.start).num_rows
        rows = ((n, normalise(row, fields)) for n, row in enumerate(records, start=1))
    else:
        data = chunk.data
        if data is None:
            with open(chunk.path, "rb") as f:  # bytes: a bad UTF-8 line is one problem, not a crash
                f.seek(chunk.start)
                data = f.read(chunk.stop - chunk.start)
        try:  # the chunk decoded at once: it fails only where a line is not UTF-8
            lines: list[Any] = data.decode("utf-8").split("\n")
        except UnicodeDecodeError:
            lines = data.split(b"\n")  # each line decoded alone: the bad one is named
        if not lines[-1]:
            lines.pop()  # the chunk's last newline ends its last line
        count, rows = len(lines), ((n, normalise(_json(raw), fields))
                                   for n, raw in enumerate(lines, start=1) if raw.strip())
    good: list[dict[str, Any]] = []
    bad: list[tuple[Any, ...]] = []
    for number, got in rows:
        if isinstance(got, tuple):
            bad.append((len(good), number, *got))
            continue
        good.append(got)
        if stop_after is not None and len(good) >= stop_after:
            break
    return count, good, bad


_SCAN = json.JSONDecoder().scan_once  # the C scanner under json.loads, without its wrappers


def _json(raw: str | bytes) -> Any:
    try:
        text = raw if isinstance(raw, str) else raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return "invalid_utf8", f"byte {err.start}: {err.reason}"
    with contextlib.suppress(StopIteration, json.JSONDecodeError):  # json.loads says what is wrong
        got, end = _SCAN(text, 0)
        if end == len(text) or not text[end:].strip():
            return got
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        return "invalid_json", f"column {err.colno}: {err.msg}"


def normalise(row: Any, fields: dict[str, str]) -> tuple[str, str] | dict[str, Any]:
    """The record the pipeline renders (fields {}: Alpaca's), or (problem, detail)."""
    if isinstance(row, tuple):
        return row
    if not isinstance(row, dict):
        return "not_an_object", f"a JSON {type(row).__name__}, expected an object"
    if "messages" in fields:
        msgs, name = row.get(fields["messages"]), fields["messages"]
        if not (isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in msgs)):
            return "not_chat", f"{name} must be a list of {{role, content}} strings"
        if msgs[-1]["role"] != "assistant" or not msgs[-1]["content"].strip():
            return "no_answer", f"the last of {name} is not an assistant's answer"
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
    names = fields or dict(zip(ALPACA_FIELDS, ALPACA_FIELDS))
    values = [row.get(c) for c in names.values()]
    if all(type(v) is str for v in values):  # the common case, checked at once
        got = dict(zip(names, values))
        empty = [names[k] for k in _NOT_EMPTY if k in got and not got[k].strip()]
        if empty:
            return "empty_text", f"{', '.join(empty)} is empty"
        return {"prompt": "", "response": got["text"]} if "text" in got else got
    missing = [c for c in names.values() if c not in row]
    if missing:
        return "missing_field", _no_field(missing[0], fields, "field", "", row)
    if fields and (null := [c for c in names.values() if row[c] is None]):
        return "missing_field", f"{', '.join(null)} is null"
    wrong = [c for c in names.values() if not isinstance(row[c], str)]
    return "not_text", f"{', '.join(wrong)} must be strings"


def _no_field(column: str, fields: dict[str, str], kind: str, where: str, names: Any) -> str:
    """A field the records lack: the flag that named it, else how to name one; what they hold."""
    flag = next((k for k, v in fields.items() if v == column), None)
    head = (f"--{flag}-field={column!r}: no such {kind}{where}" if flag else f"--source: no {kind}"
            f" {column!r}{where} (name yours with --text-field or --prompt-field/--response-field)")
    return f"{head}; its {kind}s: {', '.join(map(str, names))}"


def read_source(path: str | os.PathLike[str], fields: dict[str, str] | None = None,
                on_error: str = "raise", limit: int | None = None, cached: bool = False
                ) -> tuple[list[dict[str, str]], Any]:
    """(records, problems frame) of a file or shards; cached: reuse a parse (never when timed)."""
    check_on_error(on_error)
    fields = dict(fields or {})
    now = [(str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in shard_files(path)] \
        if cached else []  # each file's (name, size, mtime_ns): the parse kept is theirs
    if not cached or sum(s[1] for s in now) > _READ_MAX_BYTES:
        return _read_once.__wrapped__((), path, tuple(fields.items()), on_error, limit)  # not kept
    records, problems = _read_once(tuple(now), path, tuple(sorted(fields.items())), on_error, limit)
    return list(records), problems.copy()  # the records are never mutated


_READ_MAX_BYTES = 256 << 20  # larger record files are read again, not kept


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}: allowed values are "
                         + ", ".join(map(repr, ON_ERROR)))


@lru_cache(maxsize=4)
def _read_once(stamps: tuple[Any, ...], path: Any, items: tuple[Any, ...], on_error: str,
               limit: int | None) -> tuple[list[dict[str, str]], Any]:
    """The parse; `stamps` (each file's name, size, mtime_ns) only keys the cache."""
    import pandas as pd

    fields, records, problems = dict(items), [], []
    lines: dict[str, int] = {}  # lines of each file read so far: chunks number from 1
    for chunk in plan_chunks(path, fields):
        left = None if limit is None else limit - len(records)
        count, good, bad = split_chunk(chunk, fields, left)
        base = lines.get(chunk.where, 0)
        problems += [problem(chunk, base + n, (kind, why), on_error) for _, n, kind, why in bad]
        records += good
        if limit is not None and len(records) >= limit:
            break
        lines[chunk.where] = base + count
    return records, pd.DataFrame(problems, columns=PROBLEM_COLUMNS)


def problem(chunk: Chunk, number: int, got: tuple[str, str], on_error: str) -> dict[str, Any]:
    """The problems frame's row for a record that does not fit; on_error="raise": its refusal."""
    if on_error == "raise":
        raise refusal(chunk.where, number, got[0], got[1], str(chunk.path).endswith(".parquet"))
    return {"line": f"{chunk.where}:{number}" if chunk.shard else number, "problem": got[0],
            "detail": got[1]}


def refusal(where: str, number: int | str, problem: str, detail: str,
            parquet: bool = False) -> ValueError:
    """The error on_error="raise" stops with: the file, the row, what is wrong, the way out."""
    word = "row" if parquet else "line"
    if detail.startswith("--"):  # a field absent: the flag first (a skip may leave out all)
        return ValueError(f"{detail} ({where}, {word} {number}); or pass --on-error skip to "
                          "leave out the records that lack it")
    return ValueError(f"--source: {where}: {word} {number}: {problem} ({detail}); pass "
                      "on_error='skip' (--on-error skip) to leave such records out and count "
                      "them")
