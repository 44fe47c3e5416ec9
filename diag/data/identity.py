"""A token cache's key: the data's identity (a file's landing manifest's, else its sha256,
memoized while size, mtime, ctime and inode stay), the tokenizer's, the settings.
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
# what a tokenizer is saved as; transformers 5 writes the chat template to its own file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
MEMO = ".identities.json"  # {path: [size, mtime_ns, ctime_ns, inode, identity]} under the caches


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_parts(source: str | os.PathLike[str] | list[dict[str, Any]],
              tokenizer_dir: str | os.PathLike[str], fields: dict[str, str] | None = None,
              memo_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Digests of what the tokens depend on: data, tokenizer, settings (memo_dir: hash memo's)."""
    if not isinstance(source, (str, os.PathLike)):
        data = sha256(json.dumps(list(source), sort_keys=True).encode())
    elif not Path(source).is_dir():
        data = file_identities(source, memo_dir)[0]
    else:  # a folder: each shard's name under it and identity, in order
        data = sha256("\n".join(f"{f.relative_to(source).as_posix()}={i}" for f, i in zip(
            shard_files(source), file_identities(source, memo_dir))).encode())
    tok = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(tokenizer_dir, name)
        if path.is_file():
            tok.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    settings = json.dumps({"format": FORMAT, "template": PROMPT_TEMPLATE,
                           "template_no_input": PROMPT_TEMPLATE_NO_INPUT,
                           "fields": dict(sorted((fields or {}).items()))})
    return {"data": data, "tokenizer": tok.hexdigest(), "settings": sha256(settings.encode())}


def file_identities(source: str | os.PathLike[str], memo_dir: Any) -> list[str]:
    """Each shard's identity, in order: the landing manifest's, the memo's, or its sha256."""
    root, found = Path(source), []
    landed, memo_path = _landed(root), Path(memo_dir, MEMO) if memo_dir is not None else None
    try:
        memo, hashed = json.loads(memo_path.read_text()) if memo_path is not None else {}, False
    except (OSError, ValueError):
        memo, hashed = {}, False
    for file in shard_files(root):
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
    if memo_path is not None and hashed:  # written whole: a lost race costs one more hash
        with atomic_file(memo_path) as tmp:  # files gone (a run's copies) are forgotten
            tmp.write_text(json.dumps({k: v for k, v in memo.items() if os.path.exists(k)}))
    return found


def _landed(root: Path) -> dict[str, tuple[int, int, str]]:
    """{file under root ("": root): (size, mtime_ns, identity)} from land()'s manifest, or {}."""
    manifest = root.with_name(root.name + MANIFEST_SUFFIX)
    try:
        written = manifest.stat().st_mtime_ns
        got = json.loads(manifest.read_text())
        prefix = got["url"].split("/", 3)[3] if got["url"].count("/") >= 3 else ""
        return {obj["key"][len(prefix):].strip("/") if root.is_dir() else "": (
            obj["size"], written, f"landed:{obj['etag']}:{obj.get('digest') or obj.get('sha256')}:"
            f"{obj['size']}") for obj in got["objects"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # none, or not one this diag wrote: the files are hashed instead
