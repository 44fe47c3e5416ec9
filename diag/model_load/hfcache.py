"""Is the Hugging Face cache on this disk what the hub served? huggingface_hub only checks that a
blob exists; `verify_cache()` re-hashes each against its name (its ETag) and, online, the hub's
checksums (`HfApi.verify_repo_checksums`)."""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from diag.files import file_digests

if TYPE_CHECKING:
    import pandas as pd

_PICKLE = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
COLUMNS = ["file", "blob", "bytes", "status", "detail"]
# what a causal-LM load needs; never pickle weights (loading one can run code)
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "tokenizer*", "*.model", "*.tiktoken",
                  "*.txt", "*.jinja"]


def offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def reachable(endpoint: str) -> None:
    """Raise OSError unless endpoint takes a connection in 3 s (huggingface_hub retries ~20 s)."""
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                             timeout=3).close()


def repo_folder(cache_dir: str | os.PathLike[str], repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def snapshot_folder(cache_dir: str | os.PathLike[str], repo_id: str, revision: str = "main"
                    ) -> Path | None:
    """The cached snapshot of repo_id@revision (a ref or a commit sha), or None."""
    repo = repo_folder(cache_dir, repo_id)
    ref = repo / "refs" / revision
    folder = repo / "snapshots" / (ref.read_text().strip() if ref.is_file() else revision)
    return folder if folder.is_dir() else None


def blob_files(cache_dir: str | os.PathLike[str], repo_id: str) -> list[Path]:
    """Every complete blob cached for repo_id."""
    blobs = repo_folder(cache_dir, repo_id) / "blobs"
    return sorted(p for p in blobs.glob("*") if p.is_file() and not p.name.endswith(".incomplete"))


def weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files a causal-LM load reads, as transformers picks them (never pickles)."""
    folder, index = Path(folder), Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        return [folder / n for n in sorted({*json.loads(index.read_text())["weight_map"].values()})]
    single = folder / "model.safetensors"
    if found := [single] if single.is_file() else sorted(folder.glob("*.safetensors")):
        return found
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(_PICKLE))
    raise ValueError(
        f"no *.safetensors weights in {folder}" + (f" (only pickle files: {', '.join(pickles)})"
                                                   if pickles else "")
        + ": diag loads safetensors only, since pickle weights can run code when loaded; "
        "convert the checkpoint with save_pretrained(..., safe_serialization=True)")


def _check_blob(blob: Path) -> tuple[str, str]:
    algo, what = {64: ("sha256", "sha256"), 40: ("git-sha1", "git blob sha1")}.get(
        len(blob.name) if re.fullmatch("[0-9a-f]+", blob.name) else 0, ("", ""))
    if not algo:
        return "unverified", "blob name is not a checksum this hub uses"
    got = file_digests(blob, algo)[algo]
    if got != blob.name:
        return "corrupt", f"{what} of the content is {got[:12]}..., expected {blob.name[:12]}..."
    return "ok", what


def _online_rows(repo_id: str, cache_dir: str | os.PathLike[str], revision: str, endpoint: str
                 ) -> list[tuple[str, str, int, str, str]]:
    """A row per cached file whose checksum differs from the hub's (one it lacks is no damage)."""
    from huggingface_hub import HfApi

    try:
        reachable(endpoint)
        got = HfApi(endpoint=endpoint).verify_repo_checksums(repo_id, revision=revision,
                                                             cache_dir=cache_dir)
    except Exception as err:  # noqa: BLE001  the offline check stands; the row says why
        return [("", "", 0, "unverified", f"online check against {endpoint} skipped: "
                 f"{type(err).__name__}")]
    return [(m["path"], "", 0, "corrupt", f"the hub's {m['algorithm']} is {m['expected'][:12]}"
             f"..., the cached file's {m['actual'][:12]}...") for m in got.mismatches]


def verify_cache(repo_id: str, cache_dir: str | os.PathLike[str], revision: str = "main", *,
                 redownload: Callable[[], None] | None = None, endpoint: str = ""
                 ) -> pd.DataFrame:
    """A row per cached file (COLUMNS); with `redownload`, what failed is deleted and re-fetched."""
    import pandas as pd

    repo = repo_folder(cache_dir, repo_id)
    rows = [("", p.name, p.stat().st_size, "incomplete", "partial download (killed or cut off)")
            for p in sorted((repo / "blobs").glob("*.incomplete"))]
    folder = snapshot_folder(cache_dir, repo_id, revision)
    if folder is None:
        rows.append(("", "", 0, "missing", f"no snapshot of {repo_id}@{revision} in {cache_dir}"))
    else:
        for link in sorted(p for p in folder.rglob("*") if p.is_symlink() or p.is_file()):
            rel, blob = link.relative_to(folder).as_posix(), link.resolve()
            rows.append((rel, blob.name, blob.stat().st_size, *_check_blob(blob)) if blob.is_file()
                        else (rel, blob.name, 0, "missing", "the link's blob is gone"))
        try:
            listed = {p.relative_to(folder).as_posix() for p in weight_files(folder)}
        except ValueError as err:
            rows.append(("", "", 0, "missing", str(err)))
        else:
            rows += [(rel, "", 0, "missing", "listed in the weight index, not in the snapshot")
                     for rel in sorted(listed - {r[0] for r in rows})]
    if endpoint and folder is not None and not offline_env():
        online = _online_rows(repo_id, cache_dir, revision, endpoint)  # its mismatches win
        local, failed = {r[0]: r for r in rows}, {o[0] for o in online if o[0]}
        rows = [r for r in rows if r[0] not in failed] + [
            (o[0], *local[o[0]][1:3], *o[3:]) if o[0] in failed and o[0] in local else o
            for o in online]
    frame = pd.DataFrame(rows, columns=COLUMNS)
    if redownload is not None and not frame["status"].isin(["ok", "unverified"]).all():
        for r in frame.itertuples():  # huggingface_hub re-fetches a file whose link is gone
            damaged = r.status in ("corrupt", "missing") and r.file and folder is not None
            if r.blob and (damaged or r.status == "incomplete"):
                (repo / "blobs" / r.blob).unlink(missing_ok=True)
            if damaged:
                (folder / r.file).unlink(missing_ok=True)
        redownload()
        after = verify_cache(repo_id, cache_dir, revision, endpoint=endpoint)
        was = dict(zip(frame["file"], frame["status"]))
        after["detail"] = [f"re-downloaded (was {was[f]})" if was.get(f, "ok") != "ok" else d
                           for f, d in zip(after["file"], after["detail"])]
        return after
    return frame


def problems(frame: pd.DataFrame) -> str:
    """One line per corrupt or missing file ('' when sound; a partial download is never loaded)."""
    bad = frame[frame["status"].isin(["corrupt", "missing"])]
    return "\n".join(f"  {r.status}: {r.file or r.blob or '-'} ({r.detail})"
                     for r in bad.itertuples())
