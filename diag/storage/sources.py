"""A --source (s3://, hf://datasets/... or local files): `list_remote`, `first_records` of a file
by ranged reads, and `fetch`, the job's data: local files in place, a hub dataset landed once in
diag's hub cache (the user's HF cache read, never written), an S3 one landed or pulled per start.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from diag.config.source import (COMPRESSED, DATA_SUFFIXES, HubUrl, LocalUrl, S3Url, data_file,
                                parse_url)
from diag.storage.objectstore import RemoteObject, failure, list_s3

SAMPLE_BYTES = 1 << 20  # a JSONL shard's first MiB (whole lines) is sampled
SAMPLE_ROWS = 1024  # a Parquet shard's first rows (ranged GETs of its footer and first pages)


def list_remote(client: Any, url: S3Url | HubUrl | LocalUrl, records: bool = False
                ) -> list[RemoteObject]:
    """Every file of the source, no download (a local file's key: its path; etag: its mtime);
    records: its record files alone, in key order (ValueError: none)."""
    if isinstance(url, S3Url):
        found = list_s3(client, url)
    elif isinstance(url, LocalUrl):
        files = sorted(p for p in url.path.rglob("*") if p.is_file()) if url.is_prefix \
            else [url.path]
        if not files:
            raise RuntimeError(f"{url}: no files in this folder (check --source)")
        found = [RemoteObject(str(p), p.stat().st_size, str(p.stat().st_mtime_ns)) for p in files]
    else:
        from huggingface_hub.hf_api import RepoFile

        folder = url.path.rsplit("/", 1)[0] if "/" in url.path else ""
        try:
            tree = client.list_repo_tree(url.repo_id, path_in_repo=(
                url.path if url.is_prefix else folder).strip("/") or None, recursive=True,
                repo_type="dataset", revision=url.revision)
            found = [RemoteObject(f.path, f.size, f.lfs.sha256 if f.lfs else f.blob_id)
                     for f in tree if isinstance(f, RepoFile)]
        except Exception as err:  # noqa: BLE001  huggingface_hub's errors: named with the URL
            raise failure(url, client, f"{type(err).__name__}: {str(err).splitlines()[0]} "
                          "(check --source and HF_ENDPOINT / HF_TOKEN)") from None
        found = [o for o in found if url.is_prefix or o.key == url.path]
        if not found:
            raise failure(url, client, "no such file or folder in the dataset repo (check "
                          "--source; a folder may end with '/')")
    if not records:
        return found
    usable = sorted((o for o in found if data_file(o.key)), key=lambda o: o.key)
    if not usable:
        raise ValueError(f"--source={str(url)!r}: no readable shard "
                         f"({', '.join(Path(o.key).name for o in found[:3])}); allowed: "
                         + ", ".join(f"*{s}" for s in DATA_SUFFIXES) + " (JSONL also "
                         + ", ".join(COMPRESSED) + ")")
    return usable


def fetch(source: str, client: Any, how: str, work: Path, records: int = 0
          ) -> tuple[Path, int, int]:
    """(path, bytes fetched, the source's data bytes) of the job's data, landed once or pulled into
    `work` (`how`); records: a prefix's first files in key order that hold that many (0: all)."""
    from diag.config import diag_home
    from diag.data.records import count_records

    url = parse_url(source)
    objects = list_remote(client, url, records=True)
    total = sum(o.size for o in objects)
    if isinstance(url, LocalUrl):
        return url.path, 0, total
    root = diag_home() / "qlora" / "landed"
    if not url.is_prefix or not records:  # the whole source at once
        return _get(url, client, how, objects, root, work), total, total
    held, fetched, path = 0, 0, work
    for obj in objects:
        path = _get(url, client, how, [obj], root, work)
        rel = obj.key[len(url.path if isinstance(url, HubUrl) else url.key):].lstrip("/")
        held, fetched = held + count_records(path / rel), fetched + obj.size
        if held >= records:
            break
    return path, fetched, total


def _get(url: S3Url | HubUrl, client: Any, how: str, objects: list[RemoteObject], root: Path,
         work: Path) -> Path:
    """These files landed under root or pulled into work: the source's path there."""
    from diag.storage.landing import land, local_paths
    from diag.storage.methods import pull

    if isinstance(url, HubUrl):
        return _hub_files(client, url, objects, root / "hub" if how == "land" else None,
                          work / "data")
    if how == "land":
        if len(objects) == 1 and url.is_prefix:
            land(f"s3://{url.bucket}/{objects[0].key}", root, client=client)
            return local_paths(url, root)[0]
        return land(str(url), root, client=client).path
    pull("boto3_default", client, url, objects, work / "data")
    return work / "data" if url.is_prefix else work / "data" / Path(url.key).name


def _hub_files(api: Any, url: HubUrl, objects: list[RemoteObject], cache: Path | None,
               work: Path) -> Path:
    """The source's path in the user's HF cache (all held), else `cache` (diag's), else work."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    where = {"repo_id": url.repo_id, "repo_type": "dataset", "revision": url.revision}
    mine = [try_to_load_from_cache(filename=o.key, **where) for o in objects]
    if cache is not None and all(isinstance(p, str) for p in mine):
        got = mine
    else:
        into = {"cache_dir": cache} if cache is not None else {"local_dir": work}
        got = [hf_hub_download(filename=o.key, endpoint=api.endpoint, **into, **where)
               for o in objects]
    top = Path(got[0])
    for _ in objects[0].key.split("/"):  # up to the repo's root, then down to the source's path
        top = top.parent
    return top / url.path if url.path else top


def first_records(client: Any, url: S3Url | HubUrl | LocalUrl, obj: RemoteObject,
                  folder: Path) -> tuple[Path, bool] | None:
    """obj's first records as the job reads them in a file in folder, and if all (None: none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / Path(obj.key).name
    raw = open(obj.key, "rb", buffering=0) if isinstance(url, LocalUrl) else \
        _Ranges(client, url, obj)
    shard = io.BufferedReader(raw, SAMPLE_BYTES)
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


class _Ranges(io.RawIOBase):
    """A record file of S3 or the hub as a seekable file of ranged GETs."""

    def __init__(self, client: Any, url: S3Url | HubUrl, obj: RemoteObject) -> None:
        self.client, self.url, self.key, self.size, self.pos = client, url, obj.key, obj.size, 0

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
        data = self._get(f"bytes={self.pos}-{self.pos + n - 1}")
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def _get(self, span: str) -> bytes:
        if isinstance(self.url, S3Url):
            return self.client.get_object(Bucket=self.url.bucket, Key=self.key,
                                          Range=span)["Body"].read()
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        got = get_session().get(hf_hub_url(self.url.repo_id, self.key, repo_type="dataset",
                                           revision=self.url.revision,
                                           endpoint=self.client.endpoint),
                                headers={**build_hf_headers(), "Range": span},
                                follow_redirects=True)
        got.raise_for_status()
        return got.content
