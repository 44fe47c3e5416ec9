"""What can be refused before the first experiment, in seconds and leaving nothing behind.

`preflight(cfg, job)` checks, in the order a run meets them, the folders, the model, the source
and (for `job`) the first shard's records as the job reads them (no torch). A refusal is one line.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.config import diag_home
from diag.config.source import COMPRESSED, DATA_SUFFIXES, check_out, data_file

if TYPE_CHECKING:
    from diag.config import QLoraConfig, SourceConfig

SAMPLE_BYTES = 1 << 20  # a JSONL shard's first MiB (whole lines) is read for the record checks
SAMPLE_ROWS = 1024  # a Parquet shard's first rows (ranged GETs of its footer and first pages)
_COVERED: ContextVar[bool] = ContextVar("diag_preflight_covered", default=False)


def preflight(cfg: SourceConfig, job: QLoraConfig | None = None) -> None:
    """Every check that applies to cfg (and job's records); a no-op inside `covered()`."""
    if _COVERED.get():
        return
    check_folders(cfg)
    if "model" in cfg.SOURCE:
        from diag.model_load import check_on_hub, weight_files

        folder = Path(cfg.model).expanduser()
        if cfg.model and folder.is_dir():
            try:  # a folder of pickle weights only is refused before any process starts
                weight_files(folder)
            except ValueError as err:
                raise ValueError(f"--model={cfg.model!r}: {err}") from None
        check_on_hub(cfg)
    if cfg.source:
        objects = check_source(cfg, data=job is not None)
        if job is not None:
            check_records(cfg, job, objects)


@contextlib.contextmanager
def covered() -> Iterator[None]:
    """Steps run inside are covered by the recipe's preflight: theirs is skipped."""
    token = _COVERED.set(True)
    try:
        yield
    finally:
        _COVERED.reset(token)


def check_folders(cfg: SourceConfig) -> None:
    """The folders cfg's command writes into: each must be (or be makeable as) a usable folder."""
    check_writable(diag_home(), "DIAG_HOME" + ("" if os.environ.get("DIAG_HOME") else " (unset)"),
                   "diag may keep its caches and assets in")
    out = getattr(cfg, "out", None)
    if out is not None:  # new or empty now, not only when the config was made
        check_out(out)
        check_writable(Path(out or "runs").expanduser(), "--out", "you can write")
    for flag, value in (("--local-dir", getattr(cfg, "local_dir", "")),
                        ("--out-dir", getattr(cfg, "out_dir", "")), ("--cache-dir", cfg.cache_dir)):
        if value:  # else a folder under DIAG_HOME
            check_writable(Path(value).expanduser(), flag, "you can write (diag fills it)")


def check_writable(path: Path, setting: str, allowed: str) -> None:
    """Refuse a folder that is a file, lies under one, or cannot be read or written."""
    where = f"{setting}={str(path)!r}"
    try:
        found = next(p for p in (path, *path.parents) if p.exists())
        if not found.is_dir():
            what = "is a file" if found == path else f"lies under a file ({found})"
            raise ValueError(f"{where}: {what}; name a folder {allowed}")
        os.listdir(found)
    except PermissionError as err:
        raise ValueError(f"{where}: cannot be read ({err.strerror}: {err.filename}); name a "
                         f"folder {allowed}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".diag-probe-", dir=found)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        made = "" if found == path else f" (it would be made in {found})"
        raise ValueError(f"{where}: cannot be written{made}: {err.strerror}; name a folder "
                         f"{allowed}") from None


def check_source(cfg: SourceConfig, data: bool = True) -> list[Any]:
    """The objects --source lists; data=True: only record files (at least one; the first HEADed)."""
    from diag.storage import list_remote, parse_url, source_client
    from diag.storage.objectstore import S3Url

    url = parse_url(cfg.source)
    client = source_client(cfg)
    objects = list_remote(client, url)  # an empty prefix is refused there
    if data:
        usable = [o for o in objects if data_file(o.key)]
        if not usable:
            raise ValueError(f"--source={cfg.source!r}: no readable shard "
                             f"({', '.join(Path(o.key).name for o in objects[:3])}); allowed: "
                             + ", ".join(f"*{s}" for s in DATA_SUFFIXES) + " (JSONL also "
                             + ", ".join(COMPRESSED) + ")")
        if isinstance(url, S3Url) and url.is_prefix:  # a LIST may be allowed, a GET not
            list_remote(client, S3Url(url.bucket, usable[0].key))
        return usable
    return objects


def check_records(cfg: SourceConfig, job: QLoraConfig, objects: list[Any]) -> None:
    """The first shard's first records held to the job's rules: no prompt may fill --seq-len,
    and (the sample being the whole source) each step needs a record."""
    from diag.config import DiagnoseConfig
    from diag.data.records import read_source
    from diag.data.text import encode_pairs, load_tokenizer
    from diag.files import scratch_folder
    from diag.storage import parse_url, source_client

    tmp = scratch_folder("diag-preflight")
    try:
        sample = sample_shard(_opener(source_client(cfg), parse_url(cfg.source)), objects[0], tmp)
        if sample is None:
            return
        records = read_source(sample[0], job.fields(), on_error=job.on_error,
                              limit=job.records)[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    filled, tokenizer = [], _tokenizer_dir(cfg)
    if tokenizer is not None:  # (index, tokens) of each prompt (BOS included) filling --seq-len
        prompts, _ = encode_pairs(load_tokenizer(str(tokenizer)), records)
        filled = [(i, len(p)) for i, p in enumerate(prompts) if len(p) >= job.seq_len]
    if filled and job.on_error == "raise":
        i, tokens = filled[0]
        raise ValueError(f"--seq-len={job.seq_len}: record {i + 1} of {cfg.source}: its prompt is "
                         f"{tokens} tokens and leaves no response token to train on; raise "
                         "--seq-len, or pass --on-error skip to leave such records out (counted)")
    usable = len(records) - len(filled)
    if sample[1] and len(objects) == 1 and usable < job.steps:  # the whole source: its count
        steps = "--job-steps" if isinstance(cfg, DiagnoseConfig) else "--steps"
        raise ValueError(f"{steps}={job.steps}: {cfg.source} holds {usable} usable records; "
                         f"each optimizer step needs at least one: lower {steps} or add records")


def sample_shard(open_shard: Any, obj: Any, folder: Path) -> tuple[Path, bool] | None:
    """The shard's first records as a file in folder, and whether that is all (None: empty)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / Path(obj.key).name
    shard = io.BufferedReader(open_shard(obj), SAMPLE_BYTES)
    if path.suffix == ".parquet":
        try:
            parquet = pq.ParquetFile(shard)
        except Exception:  # noqa: BLE001  not Parquet: its first bytes, refused by the job's reader
            shard.seek(0)
            path.write_bytes(shard.read(SAMPLE_BYTES))
            return path, True
        first = next(parquet.iter_batches(batch_size=SAMPLE_ROWS), None)
        table = pa.Table.from_batches([first] if first is not None else [], parquet.schema_arrow)
        pq.write_table(table, path)
        return path, table.num_rows == parquet.metadata.num_rows
    if path.suffix in COMPRESSED:  # decompressed as it streams, as the job reads it
        codec = {".gz": "gzip", ".zst": "zstd"}[path.suffix]
        shard = io.BufferedReader(pa.CompressedInputStream(shard, codec))
        path = path.with_suffix("")
    body = shard.read(SAMPLE_BYTES)
    whole = len(shard.read(1)) == 0
    body = body if whole else body[:body.rfind(b"\n") + 1]
    if not body:
        return None
    path.write_bytes(body)
    return path, whole


def _opener(client: Any, url: Any) -> Any:
    """obj -> the shard as a seekable binary file: ranged GETs (S3, the hub), or the file."""
    from diag.storage.sources import HubUrl, LocalUrl

    if isinstance(url, LocalUrl):
        return lambda obj: open(obj.key, "rb", buffering=0)
    if isinstance(url, HubUrl):
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        def hub(obj: Any, first: int, last: int) -> bytes:
            where = hf_hub_url(url.repo_id, obj.key, repo_type="dataset",
                               revision=url.revision, endpoint=client.endpoint)
            got = get_session().get(where, headers={**build_hf_headers(),
                                                    "Range": f"bytes={first}-{last}"},
                                    follow_redirects=True)
            got.raise_for_status()
            return got.content

        return lambda obj: _Ranges(obj, hub)
    return lambda obj: _Ranges(obj, lambda o, first, last: client.get_object(
        Bucket=url.bucket, Key=o.key, Range=f"bytes={first}-{last}")["Body"].read())


class _Ranges(io.RawIOBase):
    """A remote file as a seekable file of ranged GETs (`get(obj, first, last)`)."""

    def __init__(self, obj: Any, get: Any) -> None:
        self.obj, self.get, self.size, self.pos = obj, get, obj.size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.get(self.obj, self.pos, self.pos + n - 1)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _tokenizer_dir(cfg: SourceConfig) -> Path | None:
    """The model's tokenizer folder when it is on this machine (None: not yet downloaded)."""
    if not cfg.model:
        from diag.embedded import ensure_assets

        return ensure_assets().model_dir
    folder = Path(cfg.model).expanduser()
    if folder.is_dir():
        return folder
    from diag.model_load import cache_dir_for, snapshot_folder

    return snapshot_folder(cache_dir_for(cfg), cfg.model, cfg.revision)
