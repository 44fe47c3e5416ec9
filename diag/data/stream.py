"""The token cache's build: `encode_chunk` tokenizes one chunk (or copies it from an older cache),
`encoded` runs them in forked processes (two per process in flight) in source order,
`write_chunks` appends them (`Arrays`) and keeps meta.json's account, shard by shard.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diag.data.records import Chunk, problem, split_chunk
from diag.data.text import encode_pairs, load_tokenizer

ENCODE_BATCH = 1000  # records per tokenizer call: amortizes the call, bounds a worker's objects
ARRAYS = ("train.bin", "loss_mask.npy", "offsets.npy")  # a cache's data files, beside meta.json
_NPY = {"loss_mask.npy": np.uint8, "offsets.npy": np.int64}  # the arrays with a header
PROBLEMS_KEPT = 1000  # records left out that meta.json lists (all of them are counted)
COPY_RECORDS = 100_000  # records of an unchanged shard copied from an older cache at once


@dataclass(frozen=True)
class Job:
    """What every chunk's tokenizing needs (pickled to each worker with its chunk)."""

    tokenizer_dir: str
    version: str  # the tokenizer's digest: a tokenizer saved again is loaded again
    dtype: str  # of the ids: the cache's (uint16 when the vocabulary fits)
    fields: dict[str, str]


@dataclass
class Encoded:
    """One chunk's good records as arrays, and the records of it that did not fit."""

    ids: np.ndarray  # every record's ids end to end, EOS closing each
    mask: np.ndarray  # uint8: 1 where the token carries loss (response and EOS)
    lengths: np.ndarray  # int64 tokens per record
    problems: list[tuple[int, int, str, str]]  # (good records before it, line, problem, detail)
    lines: int  # lines (rows) of the chunk: the next chunk of the file numbers after them

    def first(self, n: int) -> Encoded:
        """The chunk cut after its first n good records (a prefix build's last chunk)."""
        tokens = int(self.lengths[:n].sum())
        return Encoded(self.ids[:tokens], self.mask[:tokens], self.lengths[:n],
                       [p for p in self.problems if p[0] < n], self.lines)


def _arrays(tokenizer: Any, records: list[dict[str, Any]], dtype: str
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, loss mask, lengths) of records: each prompt (no loss), response + EOS (loss)."""
    prompts, responses = encode_pairs(tokenizer, records)
    p = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    r = np.fromiter(map(len, responses), dtype=np.int64, count=len(responses))
    lengths = p + r + 1
    starts = np.cumsum(lengths) - lengths
    ids = np.empty(int(lengths.sum()), dtype=dtype)
    mask = np.ones(len(ids), dtype=np.uint8)
    for part, n, at in ((prompts, p, starts), (responses, r, starts + p)):
        flat = np.fromiter(itertools.chain.from_iterable(part), dtype=dtype, count=int(n.sum()))
        where = np.repeat(at - (np.cumsum(n) - n), n) + np.arange(len(flat))  # each id's place
        ids[where] = flat
        if part is prompts:
            mask[where] = 0
    ids[starts + lengths - 1] = tokenizer.eos_token_id
    return ids, mask, lengths


def encode_chunk(job: Job, chunk: Chunk, stop_after: int | None) -> Encoded:
    """One chunk read and tokenized (a copy: from its cache), up to `stop_after` good records."""
    if chunk.copy is not None:
        folder, dtype, first, end, lines, problems = chunk.copy
        offsets = np.load(folder / "offsets.npy", mmap_mode="r")
        a, b = int(offsets[first]), int(offsets[end])
        ids = np.fromfile(folder / "train.bin", dtype, b - a, offset=a * np.dtype(dtype).itemsize)
        mask = np.load(folder / "loss_mask.npy", mmap_mode="r")[a:b]
        return Encoded(ids, np.array(mask), np.diff(offsets[first:end + 1]),
                       [tuple(p) for p in problems], lines)
    tokenizer = load_tokenizer(job.tokenizer_dir, job.version)
    lines, records, problems = split_chunk(chunk, job.fields, stop_after)
    parts = [_arrays(tokenizer, records[i:i + ENCODE_BATCH], job.dtype)
             for i in range(0, max(len(records), 1), ENCODE_BATCH)]
    return Encoded(*(np.concatenate(p) for p in zip(*parts)), problems, lines)


def encoded(chunks: Iterator[Chunk], job: Job, procs: int,
            stop_after: Callable[[], int | None]) -> Iterator[tuple[Chunk, Encoded]]:
    """(chunk, its arrays) in source order; procs > 1: a forked pool that stops with the caller."""
    head = list(itertools.islice(chunks, 2))
    chunks = itertools.chain(head, chunks)
    if procs == 1 or len(head) < 2:
        for chunk in chunks:
            yield chunk, encode_chunk(job, chunk, stop_after())
        return
    with _pool(procs) as pool:
        window: deque[tuple[Chunk, Any]] = deque()
        try:
            for chunk in chunks:
                window.append((chunk, pool.apply_async(encode_chunk, (job, chunk, stop_after()))))
                if len(window) >= 2 * procs:  # the oldest is written before more are handed out
                    chunk, result = window.popleft()
                    yield chunk, result.get()
            while window:
                chunk, result = window.popleft()
                yield chunk, result.get()
        except (GeneratorExit, Exception):
            # stopped early: chunks in flight finish first (a worker killed mid-put keeps a lock)
            for _, result in window:
                result.wait()
            pool.close()  # the workers leave on their own, holding no lock: `with` ends nothing
            pool.join()
            raise
        pool.close()
        pool.join()


@contextlib.contextmanager
def _pool(procs: int) -> Iterator[Any]:
    import multiprocessing

    # one tokenizer thread per worker (this process keeps its own); SIGTERM blocked over the fork
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        pool = multiprocessing.get_context("fork").Pool(  # the tokenizer is inherited
            procs, initializer=_worker_signals)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    with pool:  # leaving it terminates the workers: only where they were not finished
        yield pool


def _worker_signals() -> None:
    """A worker dies at SIGTERM running no Python (a copied handler would remove parent files)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class Arrays:
    """A cache's arrays, appended chunk by chunk; the .npy headers rewritten at the end."""

    def __init__(self, folder: Path, dtype: str) -> None:
        self.files = {name: open(folder / name, "wb") for name in ARRAYS}
        self.records = self.tokens = 0
        self._room = {name: self._header(name, 0) for name in _NPY}
        self.files["offsets.npy"].write(np.zeros(1, np.int64).tobytes())

    def _header(self, name: str, length: int) -> int:
        np.lib.format.write_array_header_1_0(self.files[name], {
            "descr": np.lib.format.dtype_to_descr(np.dtype(_NPY[name])), "fortran_order": False,
            "shape": (length,)})
        return self.files[name].tell()

    def append(self, part: Encoded) -> None:
        self.files["train.bin"].write(part.ids.tobytes())
        self.files["loss_mask.npy"].write(part.mask.tobytes())
        ends = self.tokens + np.cumsum(part.lengths, dtype=np.int64)
        self.files["offsets.npy"].write(ends.tobytes())
        self.records += len(part.lengths)
        self.tokens += len(part.ids)

    def finish(self) -> None:
        """Headers with the final lengths, every byte handed to the OS (atomic_folder fsyncs)."""
        for name, length in (("loss_mask.npy", self.tokens), ("offsets.npy", self.records + 1)):
            f = self.files[name]
            f.flush()
            end = f.tell()
            f.seek(0)
            assert self._header(name, length) == self._room[name], "header outgrew room"
            f.seek(end)
        for f in self.files.values():
            f.flush()  # a full disk says so here, inside the build, not at close

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def with_copies(chunks: Any, ids: dict[Path, Any], reused: dict[str, Any]) -> Any:
    """The chunks, each shard held in `reused` replaced by copy chunks of its records."""
    done = set()
    for chunk in chunks:
        hit = reused.get(ids[chunk.path][1]) if chunk.path in ids else None  # new: tokenized
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
                        copy=(folder, dtype, a, b, e["lines"] if last else 0, problems))


def write_chunks(tmp: Path, chunks: Any, job: Job, procs: int, limit: int | None,
                 on_error: str, ids: dict[Path, Any]) -> dict[str, Any]:
    """Every chunk's arrays into tmp, in order; meta.json's account of them, shard by shard."""
    arrays = Arrays(tmp, job.dtype)
    shards: dict[str, dict[str, Any]] = {}
    problems: list[dict[str, Any]] = []
    read, full = 0, False
    try:
        remaining = (lambda: None) if limit is None else (lambda: limit - arrays.records)
        with contextlib.closing(encoded(chunks, job, procs, remaining)) as parts:
            for chunk, part in parts:  # closed on the way out: a pool's workers stop at once
                if limit is not None and arrays.records + len(part.lengths) >= limit:
                    part, full = part.first(limit - arrays.records), True
                shard = shards.setdefault(chunk.where, {  # "lines": its file's so far
                    "where": chunk.where, "identity": ids.get(chunk.path, ((), ""))[1],
                    "first": arrays.records, "records": 0, "problems": [], "lines": 0})
                base = shard["lines"]  # a chunk numbers its own lines from 1
                for before, number, *got in part.problems:
                    shard["problems"].append((arrays.records + before - shard["first"],
                                              base + number, *got))
                    row = problem(chunk, base + number, tuple(got), on_error)  # "raise": refused
                    if len(problems) < PROBLEMS_KEPT:  # and the good records read before it
                        problems.append({**row, "record": arrays.records + before})
                shard["lines"] = base + part.lines
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
            "complete": not full, "problems": problems,
            "skipped": sum(len(shard["problems"]) for shard in shards.values()),
            "shards": list(shards.values()),
            "build": {"bytes": read, "processes": procs}}
