"""What can be checked before the first experiment, without measuring: seconds, not minutes.

`preflight(cfg, out=..., data=True)` refuses, with one line naming the flag and what is allowed,
an output folder that is not empty, a cache folder that cannot be made, and (with --source) a
profile that does not exist, missing credentials, an unreachable or private bucket, and a prefix
with no shard diag can read. It lists the source (HEAD or LIST: no GET) and writes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from diag.config.source import DATA_SUFFIXES, check_cache_dir, check_out

if TYPE_CHECKING:
    from diag.config import SourceConfig


def check_source(cfg: SourceConfig, data: bool = True) -> int:
    """List --source with every source flag; returns the objects found. data=True (the job
    trains on them) also asks for at least one JSONL / Parquet object."""
    from diag.storage.objectstore import S3Url, list_remote, parse_url, source_client

    url = parse_url(cfg.source)
    client = source_client(cfg)
    objects = list_remote(client, url)
    if url.is_prefix and not objects:
        raise ValueError(f"--source={cfg.source!r}: nothing under this prefix; name a prefix "
                         "that holds *.jsonl or *.parquet shards")
    if data:
        usable = [o for o in objects if Path(o.key).suffix in DATA_SUFFIXES]
        if not usable:
            raise ValueError(f"--source={cfg.source!r}: no readable shard "
                             f"({', '.join(Path(o.key).name for o in objects[:3])}); allowed: "
                             + ", ".join(f"*{s}" for s in DATA_SUFFIXES))
        if url.is_prefix:  # a store may let anyone LIST and still refuse the objects: HEAD one
            list_remote(client, S3Url(url.bucket, usable[0].key))
    return len(objects)


def preflight(cfg: SourceConfig, out: str = "", data: bool = True) -> None:
    """Every check that applies to cfg; raises ValueError / RuntimeError (exit 2): a missing
    profile, missing credentials or a private bucket under --no-sign-request fail the listing
    with diag.storage's one-line message naming the flag."""
    check_out(out)
    check_cache_dir(cfg.cache_dir)
    if cfg.source:
        check_source(cfg, data=data)
