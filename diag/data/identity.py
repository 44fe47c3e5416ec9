"""What a token cache's key is made of: the data's identity, the tokenizer's, the settings.

A file's identity is its landing manifest's, else its sha256 kept in a memo while its size,
mtime, ctime and inode stay; the key is by content, not path.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from diag.config.source import MANIFEST_SUFFIX
from diag.data.records import shard_files
from diag.data.text import PROMPT_TEMPLATE, PROMPT_TEMPLATE_NO_INPUT
from diag.files import atomic_file, file_sha256

FORMAT = 4  # bump when the arrays' layout or the encoding changes: every old cache goes stale
#            (4: a chat template's prompt gets no second BOS)
# what a tokenizer is saved as; transformers 5 writes the chat template to its own file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
MEMO = ".identities.json"  # {path: [size, mtime_ns, ctime_ns, inode, identity]} under the caches


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_parts(source: str | os.PathLike[str] | list[dict[str, Any]],
              tokenizer_dir: str | os.PathLike[str], fields: dict[str, str] | None = None,
              memo_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The three things the tokens depend on, each as a digest: data, tokenizer, settings.
    memo_dir: where the memo of files already hashed is kept (None: none is kept)."""
    if isinstance(source, (str, os.PathLike)):
        data = data_identity(source, memo_dir)
    else:
        data = sha256(json.dumps(list(source), sort_keys=True).encode())
    tok = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(tokenizer_dir, name)
        if path.is_file():
            tok.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    settings = json.dumps({"format": FORMAT, "template": PROMPT_TEMPLATE,
                           "template_no_input": PROMPT_TEMPLATE_NO_INPUT,
                           "fields": dict(sorted((fields or {}).items()))})
    return {"data": data, "tokenizer": tok.hexdigest(), "settings": sha256(settings.encode())}


def data_identity(source: str | os.PathLike[str], memo_dir: str | os.PathLike[str] | None
                  ) -> str:
    """One file's identity, or a folder's: each shard's name under it and identity, in order."""
    root, files = Path(source), shard_files(source)
    found = file_identities(source, memo_dir)
    if not root.is_dir():
        return found[0]
    return sha256("\n".join(f"{f.relative_to(root).as_posix()}={i}"
                            for f, i in zip(files, found)).encode())


def file_identities(source: str | os.PathLike[str], memo_dir: str | os.PathLike[str] | None
                    ) -> list[str]:
    """Each shard's identity, in shard_files' order: the landing manifest's, the memo's, or its
    sha256 (then kept in the memo)."""
    root = Path(source)
    files = shard_files(root)
    landed = _landed(root)
    memo_path = Path(memo_dir, MEMO) if memo_dir is not None else None
    memo, hashed = _load(memo_path), False
    found = []
    for file in files:
        st = file.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        name = file.relative_to(root).as_posix() if root.is_dir() else ""
        known = landed.get(name)
        if known is not None and known[0] == st.st_size and st.st_mtime_ns <= known[1]:
            found.append(known[2])  # landed and untouched since its manifest was written
            continue
        old = memo.get(str(file.resolve()))
        if old is None or old[:4] != stamp:
            old = memo[str(file.resolve())] = [*stamp, "sha256:" + file_sha256(file)]
            hashed = True
        found.append(old[4])
    if memo_path is not None and hashed:
        _save(memo_path, memo)
    return found


def _landed(root: Path) -> dict[str, tuple[int, int, str]]:
    """{file under root ("" for root itself): (size, manifest mtime_ns, identity)} from the
    manifest diag.storage.land writes beside what it lands; {} where there is none."""
    manifest = root.with_name(root.name + MANIFEST_SUFFIX)
    try:
        written = manifest.stat().st_mtime_ns
        got = json.loads(manifest.read_text())
        prefix = got["url"].split("/", 3)[3] if got["url"].count("/") >= 3 else ""
        found = {}
        for obj in got["objects"]:
            name = obj["key"][len(prefix):].strip("/") if root.is_dir() else ""
            check = obj.get("digest") or obj.get("sha256")
            found[name] = (obj["size"], written, f"landed:{obj['etag']}:{check}:{obj['size']}")
        return found
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # none, or not one this diag wrote: the files are hashed instead


def _load(path: Path | None) -> dict[str, list[Any]]:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


def _save(path: Path, memo: dict[str, list[Any]]) -> None:
    """Written whole (atomic_file): a reader sees the old memo or the new; a lost race only
    costs the loser's files one more hash."""
    with atomic_file(path) as tmp:
        # files gone (a run's temporary copy of the data) are forgotten: the memo stays small
        tmp.write_text(json.dumps({k: v for k, v in memo.items() if os.path.exists(k)}))
