"""A --source (s3://, hf://datasets/... or local files): `parse_url`, `list_remote`, and `fetch`,
the job's data: local files in place, a hub dataset landed once in diag's hub cache (the user's
HF cache read, never written), an S3 one landed or pulled per start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.config.source import data_file, source_kind
from diag.storage.objectstore import RemoteObject, S3Url, failure, list_s3, parse_s3


@dataclass(frozen=True)
class HubUrl:
    repo_id: str
    revision: str
    path: str  # one data file, or a folder ("": the repo) of them

    @property
    def is_prefix(self) -> bool:
        return not data_file(self.path)

    def __str__(self) -> str:
        at = "" if self.revision == "main" else f"@{self.revision}"
        return f"hf://datasets/{self.repo_id}{at}/{self.path}"


@dataclass(frozen=True)
class LocalUrl:
    path: Path

    @property
    def is_prefix(self) -> bool:
        return self.path.is_dir()

    def __str__(self) -> str:
        return str(self.path)


def parse_url(source: str) -> S3Url | HubUrl | LocalUrl:
    """The source's kind and parts (ValueError: none of s3://, hf://datasets/, a local path)."""
    kind = source_kind(source, "source")
    if kind == "hf":
        org, name, *rest = source[len("hf://datasets/"):].split("/")
        name, _, revision = name.partition("@")
        return HubUrl(f"{org}/{name}", revision or "main", "/".join(rest))
    if kind == "local":
        return LocalUrl(Path(source).expanduser().resolve())
    return parse_s3(source)


def list_remote(client: Any, url: S3Url | HubUrl | LocalUrl) -> list[RemoteObject]:
    """Every file of the source, no download (a local file's key: its path; etag: its mtime)."""
    if isinstance(url, S3Url):
        return list_s3(client, url)
    if isinstance(url, LocalUrl):
        files = sorted(p for p in url.path.rglob("*") if p.is_file()) if url.is_prefix \
            else [url.path]
        if not files:
            raise RuntimeError(f"{url}: no files in this folder (check --source)")
        return [RemoteObject(str(p), p.stat().st_size, str(p.stat().st_mtime_ns)) for p in files]
    from huggingface_hub.hf_api import RepoFile

    folder = url.path.rsplit("/", 1)[0] if "/" in url.path else ""
    try:
        tree = client.list_repo_tree(url.repo_id, path_in_repo=(url.path if url.is_prefix else
                                                                folder).strip("/") or None,
                                     recursive=True, repo_type="dataset", revision=url.revision)
        found = [RemoteObject(f.path, f.size, f.lfs.sha256 if f.lfs else f.blob_id)
                 for f in tree if isinstance(f, RepoFile)]
    except Exception as err:  # noqa: BLE001  huggingface_hub's errors: named with the URL
        raise failure(url, client, f"{type(err).__name__}: {str(err).splitlines()[0]} (check "
                      "--source and HF_ENDPOINT / HF_TOKEN)") from None
    found = [o for o in found if url.is_prefix or o.key == url.path]
    if not found:
        raise failure(url, client, "no such file or folder in the dataset repo (check --source; "
                      "a folder may end with '/')")
    return found


def fetch(source: str, client: Any, how: str, work: Path, records: int = 0
          ) -> tuple[Path, int, int]:
    """The data a job trains on, `how` ("land": once, reused; "pull": into `work` per start):
    (its path, bytes fetched, the source's data bytes); with `records`, a prefix's first files in
    key order until they hold that many (0: all)."""
    from diag.config import diag_home
    from diag.data.records import count_records

    url = parse_url(source)
    objects = sorted((o for o in list_remote(client, url) if data_file(o.key)), key=lambda o: o.key)
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
