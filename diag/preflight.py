"""What can be refused before the first experiment, in seconds and leaving nothing behind:
`preflight(cfg, job)` checks, in the order a run meets them, the folders, the model, the source
and (for `job`) the first shard's records as the job reads them (no torch). A refusal is one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

from diag.config import diag_home
from diag.config.source import S3Url, check_out

if TYPE_CHECKING:
    from diag.config import QLoraConfig, SourceConfig

_COVERED: ContextVar[bool] = ContextVar("diag_preflight_covered", default=False)


def preflight(cfg: SourceConfig, job: QLoraConfig | None = None) -> None:
    """Every check that applies to cfg (and job's records); a no-op inside `covered()`."""
    if _COVERED.get():
        return
    # the folders cfg's command writes into: each must be (or be makeable as) a usable folder
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
        check_source(cfg, job)


@contextlib.contextmanager
def covered() -> Iterator[None]:
    """Steps run inside are covered by the recipe's preflight: theirs is skipped."""
    token = _COVERED.set(True)
    try:
        yield
    finally:
        _COVERED.reset(token)


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


def check_source(cfg: SourceConfig, job: QLoraConfig | None = None) -> None:
    """--source lists; for job, its first record file's first records pass the job's rules."""
    from diag.config import DiagnoseConfig
    from diag.data.records import read_source
    from diag.data.text import encode_pairs, load_tokenizer
    from diag.embedded import ensure_assets
    from diag.files import scratch_folder
    from diag.model_load import cache_dir_for, snapshot_folder
    from diag.storage import list_remote, source_client
    from diag.storage.sources import first_records

    url, client = cfg.url, source_client(cfg)
    objects = list_remote(client, url, records=job is not None)  # an empty prefix is refused there
    if job is None:
        return
    if isinstance(url, S3Url) and url.is_prefix:  # a LIST may be allowed, a GET not
        list_remote(client, S3Url(url.bucket, objects[0].key))
    tmp = scratch_folder("diag-preflight")
    try:
        got = first_records(client, url, objects[0], tmp)
        if got is None:
            return
        records = read_source(got[0], job.fields(), on_error=job.on_error, limit=job.records)[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    filled, model = [], Path(cfg.model).expanduser()
    if not cfg.model:
        model = ensure_assets().model_dir
    elif not model.is_dir():  # a hub id: its tokenizer when it is in the cache (else unchecked)
        model = snapshot_folder(cache_dir_for(cfg), cfg.model, cfg.revision)
    # no prompt (BOS included) may fill --seq-len; the whole source must hold a record per step
    if model is not None:  # (index, tokens) of each prompt filling --seq-len
        prompts, _ = encode_pairs(load_tokenizer(str(model)), records)
        filled = [(i, len(p)) for i, p in enumerate(prompts) if len(p) >= job.seq_len]
    if filled and job.on_error == "raise":
        i, tokens = filled[0]
        raise ValueError(f"--seq-len={job.seq_len}: record {i + 1} of {cfg.source}: its prompt is "
                         f"{tokens} tokens and leaves no response token to train on; raise "
                         "--seq-len, or pass --on-error skip to leave such records out (counted)")
    usable = len(records) - len(filled)
    if got[1] and len(objects) == 1 and usable < job.steps:  # the whole source: its count
        steps = "--job-steps" if isinstance(cfg, DiagnoseConfig) else "--steps"
        raise ValueError(f"{steps}={job.steps}: {cfg.source} holds {usable} usable records; "
                         f"each optimizer step needs at least one: lower {steps} or add records")
