"""A --source (s3://, hf://datasets/... or local files): `list_remote`, `first_records` of a file
by ranged reads, and `fetch`, the job's data: local files in place, a hub dataset landed once in
diag's hub cache (the user's HF cache read, never written), an S3 one landed or pulled per start.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from diag.config import diag_home
from diag.config.source import COMPRESSED, HubUrl, LocalUrl, S3Url, parse_url, record_files
from diag.data.records import count_records, open_records
from diag.storage.landing import land, local_paths
from diag.storage.sample import pull
from diag.storage.objectstore import RemoteObject, failure, list_s3

SAMPLE_BYTES = 1 << 20  # a JSONL shard's first MiB (whole lines) is sampled
SAMPLE_ROWS = 1024  # a Parquet shard's first rows (ranged GETs of its footer and first pages)


def list_remote(client: Any, url: S3Url | HubUrl | LocalUrl, records: bool = False
                ) -> list[RemoteObject]:
    """The files, unfetched (local: key = path, etag = mtime); records: the record files, by key."""
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

        try:
            tree = client.list_repo_tree(url.repo_id, path_in_repo=(
                url.path if url.is_prefix else url.path.rpartition("/")[0]).strip("/") or None,
                recursive=True, repo_type="dataset", revision=url.revision)
            found = [RemoteObject(f.path, f.size, f.lfs.sha256 if f.lfs else f.blob_id)
                     for f in tree if isinstance(f, RepoFile)]
        except Exception as err:  # noqa: BLE001  huggingface_hub's errors: named with the URL
            raise failure(url, client, f"{type(err).__name__}: {str(err).splitlines()[0]} "
                          "(check --source and HF_ENDPOINT / HF_TOKEN)") from None
        found = [o for o in found if url.is_prefix or o.key == url.path]
        if not found:
            raise failure(url, client, "no such file or folder in the dataset repo (check "
                          "--source; a folder may end with '/')")
    return record_files(sorted(found, key=lambda o: o.key), url, lambda o: o.key) if records \
        else found


def fetch(source: str, client: Any, how: str, work: Path, records: int = 0
          ) -> tuple[Path, int, int]:
    """(path, bytes fetched, data bytes), landed or pulled; records: the first files' (0: all)."""
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
        held, fetched = held + count_records(path / rel, records - held), fetched + obj.size
        if held >= records:
            break
    return path, fetched, total


def _get(url: S3Url | HubUrl, client: Any, how: str, objects: list[RemoteObject], root: Path,
         work: Path) -> Path:
    """The source's path once these are landed under root (or in the user's HF cache) or pulled."""
    if how == "land" and isinstance(url, HubUrl):
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        where = {"repo_id": url.repo_id, "repo_type": "dataset", "revision": url.revision}
        got = [try_to_load_from_cache(filename=o.key, **where) for o in objects]
        if not all(isinstance(p, str) for p in got):
            got = [hf_hub_download(filename=o.key, endpoint=client.endpoint, cache_dir=root / "hub",
                                   **where) for o in objects]
        top = Path(got[0]).parents[objects[0].key.count("/")]  # the repo's root in the cache
        return top / url.path
    if how == "land":
        if len(objects) == 1 and url.is_prefix:
            land(f"s3://{url.bucket}/{objects[0].key}", root, client=client)
            return local_paths(url, root)[0]
        return land(str(url), root, client=client).path
    hub = isinstance(url, HubUrl)  # a hub's: the repo's paths under work/data
    pull("hf_hub" if hub else "boto3_default", client, url, objects, work / "data")
    return work / "data" / (url.path if hub else "" if url.is_prefix else Path(url.key).name)


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
        shard, path = open_records(path, shard), path.with_suffix("")
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
