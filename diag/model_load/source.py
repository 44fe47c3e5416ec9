"""Where the model comes from, which HF cache the cached scenarios read, and the errors users read.
A hub id reads the user's own cache (never written without --repair-cache) unless --cache-dir.
huggingface_hub only checks that a cached blob exists; `verify_cache()` re-hashes each against its
name (its ETag) and, online, the hub's checksums (`HfApi.verify_repo_checksums`)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import socket
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from diag.config import ModelLoadConfig, SourceConfig, diag_home
from diag.files import file_digests
from diag.secrets import redact

if TYPE_CHECKING:
    import pandas as pd

_PICKLE = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
COLUMNS = ["file", "blob", "bytes", "status", "detail"]  # verify_cache's
# what a causal-LM load needs; never pickle weights (loading one can run code)
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "tokenizer*", "*.model", "*.tiktoken",
                  "*.txt", "*.jinja"]


@dataclass(frozen=True)
class Source:  # where the model comes from and what a load process needs to reach it
    model: str  # the repo id, or the local folder
    revision: str
    endpoint: str  # "" for a local folder
    local_dir: Path | None
    env: dict[str, str]
    user_cache: bool = False  # the cached scenarios read the user's own HF cache
    files: tuple[str, ...] = ()  # pinned to a cached commit: the only files a load may ask for


def user_hub_cache() -> Path:
    """The user's HF hub cache by huggingface_hub's rules, run afresh (`constants` froze them)."""
    spec = importlib.util.find_spec("huggingface_hub.constants")  # raises without huggingface_hub
    constants = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(constants)  # type: ignore[union-attr]  not in sys.modules: ours only
    return Path(constants.HF_HUB_CACHE)


def user_cache(cfg: SourceConfig) -> bool:
    """Is cache_dir_for(cfg) the user's own HF cache (a hub id, no --cache-dir)?"""
    return not cfg.cache_dir and bool(cfg.model) and not Path(cfg.model).expanduser().is_dir()


def cache_dir_for(cfg: SourceConfig | None = None) -> Path:
    """The persistent HF cache: --cache-dir, else a hub id's the user's, else DIAG_HOME/hf-cache."""
    if cfg is not None and cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return user_hub_cache() if cfg is not None and user_cache(cfg) else diag_home() / "hf-cache"


@contextlib.contextmanager
def open_source(cfg: ModelLoadConfig) -> Iterator[Source]:
    """The embedded hub (started here, stopped after), a hub id, or a local folder."""
    base = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    if not cfg.model:
        from diag.embedded import HubServer, ensure_assets

        if os.environ.get("HF_ENDPOINT"):  # it serves a --model; none was given
            warnings.warn(redact(f"HF_ENDPOINT={os.environ['HF_ENDPOINT']} is set, but no --model "
                                 "was given: diag loads its embedded model from its own hub; "
                                 "pass --model org/name to load yours from HF_ENDPOINT"),
                          RuntimeWarning, stacklevel=3)
        assets = ensure_assets()
        with HubServer(assets.hub_root) as hub:
            yield Source(assets.repo_id, cfg.revision, hub.endpoint, None, {**base, **hub.env()})
        return
    folder = Path(cfg.model).expanduser()
    if folder.is_dir():
        weight_files(folder)  # refuse pickle-only folders before any process starts
        yield Source(str(folder.resolve()), "", "", folder.resolve(), base)
        return
    # (config.check_model refused a path that is not a folder)
    yield Source(cfg.model, cfg.revision, hub_endpoint(), None, base, user_cache=not cfg.cache_dir)


def hub_endpoint() -> str:
    """Where a hub id is fetched from: HF_ENDPOINT, else the Hugging Face hub."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def check_on_hub(cfg: SourceConfig) -> None:
    """Refuse in one line a hub --model or --revision that neither the cache nor the hub has."""
    if not cfg.model or Path(cfg.model).expanduser().is_dir() or offline_env() \
            or snapshot_folder(cache_dir_for(cfg), cfg.model, cfg.revision):
        return
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    endpoint, what = hub_endpoint(), f"--model={cfg.model!r}"
    refusals = ((GatedRepoError, f"{what}: gated at {endpoint}; accept its terms on the hub and "
                 "set HF_TOKEN to a token with access"),  # before its base class, next
                (RepositoryNotFoundError, f"{what}: no such model at {endpoint}; check the id (a "
                 "private one needs HF_TOKEN with access to it)"),
                (RevisionNotFoundError, f"--revision={cfg.revision!r}: {cfg.model} at {endpoint} "
                 "has no such branch, tag or commit; name one it has"),
                (EntryNotFoundError, f"{what}: no config.json at {endpoint}@{cfg.revision}: not a "
                 "transformers model; name a causal LM's repo"))
    try:
        reachable(endpoint)
        get_hf_file_metadata(hf_hub_url(cfg.model, "config.json", revision=cfg.revision,
                                        endpoint=endpoint), timeout=10)
    except Exception as err:  # noqa: BLE001  the network, not the id: the load reports it
        refusal = next((text for kind, text in refusals if isinstance(err, kind)), None)
        if refusal:
            raise ValueError(redact(refusal)) from None


def pin_to_cache(src: Source, cache_dir: Path) -> tuple[Source, str]:
    """src pinned to the commit and files the user's cache holds; a line if the hub moved on."""
    folder = snapshot_folder(cache_dir, src.model, src.revision)
    if folder is None:
        raise not_in_user_cache(src.model, src.revision, cache_dir)
    files = tuple(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                         if p.is_file() or p.is_symlink()))
    commit = ""
    with contextlib.suppress(Exception):  # the loads report their own failures
        if not offline_env():
            reachable(src.endpoint)
            from huggingface_hub import HfApi

            commit = HfApi(endpoint=src.endpoint).model_info(src.model, revision=src.revision).sha
    pinned = dataclasses.replace(src, revision=folder.name, files=files)
    if not commit or commit == folder.name:
        return pinned, ""
    return pinned, (f"{src.model}@{src.revision} moved: your HF cache holds commit "
                    f"{folder.name[:12]}, the hub's is {commit[:12]}; diag loaded the cached "
                    "commit and downloaded nothing into your cache (--repair-cache, or `hf "
                    f"download {src.model}`, updates it)")


def request(src: Source, cfg: ModelLoadConfig, cache_dir: Path, mode: str = "load",
            read_only: bool = False, offline: bool = False, own_xet: bool = True
            ) -> tuple[dict[str, Any], dict[str, str]]:
    """A load process's job (read_only: the user's pinned cache) and the env it adds."""
    return ({"mode": mode, "model": src.model, "revision": src.revision or "main",
             "cache_dir": str(cache_dir), "local_dir": str(src.local_dir or ""),
             "only": list(src.files), "read_only": read_only, "quantize": cfg.quantize,
             "device": cfg.device, "trust_remote_code": cfg.trust_remote_code},
            {**({"HF_XET_CACHE": str(cache_dir / ".xet")} if own_xet else {}),
             **({"HF_HUB_OFFLINE": "1"} if offline else {})})


def failure(result: dict[str, Any], src: Source, cache_dir: Path, timeout_s: float) -> RuntimeError:
    """The error a user reads: what failed, where, and what to do."""
    kind, what = result["error"], f"{src.model}@{src.revision or 'main'}"
    warm = (f"warm the cache once with network access: hf download {src.model} --cache-dir "
            f"{cache_dir} (or python -m diag model-load --model {src.model} --cache-dir "
            f"{cache_dir} --scenarios cached), then run offline")
    texts = {
        "repo_not_found": f"model {src.model!r} not found at {src.endpoint}: check the id; a "
                          "private or gated model needs HF_TOKEN with access to it",
        "revision_not_found": f"revision {src.revision!r} of model {src.model!r} not found at "
                              f"{src.endpoint}: name a branch, tag or commit that exists",
        "offline_not_cached": f"HF_HUB_OFFLINE=1 is set and {what} is not in the HF cache at "
                              f"{cache_dir}: nothing to load offline; {warm}",
        "unreachable_not_cached": f"the hub at {src.endpoint} cannot be reached and {what} is "
                                  f"not in the HF cache at {cache_dir}; {warm}",
        "remote_code": f"{src.model} needs trust_remote_code=True, which runs Python code from "
                       "the model repo on this machine; pass --trust-remote-code only for a "
                       f"repo you trust ({result['message'][:300]})",
        "timeout": f"loading {src.model!r} took longer than timeout_s={timeout_s:g} s; raise "
                   "--timeout-s for a large model on a slow link",
        "crashed": f"the model-load process for {what} ended with no result "
                   f"({result['type']}); its last output:\n{result['message']}",
    }
    text = texts.get(kind, f"loading {what} failed: {result['type']}: {result['message']}")
    return RuntimeError(redact(text))


def not_in_user_cache(model: str, revision: str, cache_dir: Path) -> RuntimeError:
    return RuntimeError(redact(
        f"{model}@{revision} is not in your HF cache at {cache_dir} (HF_HUB_CACHE); "
        "diag reads your cache and writes nothing to it unless you pass --repair-cache: fill "
        f"it with `hf download {model}`, or pass --repair-cache to let diag download into "
        "it, or --cache-dir DIR for a cache of diag's own"))


def offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def reachable(endpoint: str) -> None:
    """Raise OSError unless endpoint takes a connection in 3 s (huggingface_hub retries ~20 s)."""
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
