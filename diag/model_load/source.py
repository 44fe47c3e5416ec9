"""Where the model comes from, which HF cache the cached scenarios read, and the errors users read.
A hub id reads the user's own cache (never written without --repair-cache) unless --cache-dir."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.config import ModelLoadConfig, SourceConfig, diag_home
from diag.model_load import hfcache
from diag.model_load.hfcache import offline_env, reachable  # noqa: F401  (reachable: re-exported)
from diag.secrets import redact


@dataclass(frozen=True)
class Source:
    """Where the model comes from and what a load process needs to reach it."""

    model: str  # the repo id, or the local folder
    revision: str
    endpoint: str  # "" for a local folder
    local_dir: Path | None
    env: dict[str, str]
    user_cache: bool = False  # the cached scenarios read the user's own HF cache
    files: tuple[str, ...] = ()  # pinned to a cached commit: the only files a load may ask for


def user_hub_cache() -> Path:
    """The user's HF hub cache by huggingface_hub's rules, run afresh (`constants` froze them)."""
    import importlib.util

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
        hfcache.weight_files(folder)  # refuse pickle-only folders before any process starts
        yield Source(str(folder.resolve()), "", "", folder.resolve(), base)
        return
    if cfg.model.startswith(("/", ".", "~")) or cfg.model.count("/") > 1:
        raise ValueError(f"ModelLoadConfig.model={cfg.model!r}: no such folder, and not a hub "
                         "id ('org/name'); allowed: '' (embedded model), a hub id, a folder")
    yield Source(cfg.model, cfg.revision, hub_endpoint(), None, base, user_cache=not cfg.cache_dir)


def hub_endpoint() -> str:
    """Where a hub id is fetched from: HF_ENDPOINT, else the Hugging Face hub."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def check_on_hub(cfg: SourceConfig) -> None:
    """Refuse in one line a hub --model or --revision that neither the cache nor the hub has."""
    if not cfg.model or Path(cfg.model).expanduser().is_dir() or offline_env() \
            or hfcache.snapshot_folder(cache_dir_for(cfg), cfg.model, cfg.revision):
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
    folder = hfcache.snapshot_folder(cache_dir, src.model, src.revision)
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


def job(src: Source, cfg: ModelLoadConfig, cache_dir: Path, mode: str = "load",
        read_only: bool = False) -> dict[str, Any]:
    """What a load process is asked to do (JSON); read_only: the user's pinned cache."""
    return {"mode": mode, "model": src.model, "revision": src.revision or "main",
            "cache_dir": str(cache_dir), "local_dir": str(src.local_dir or ""),
            "only": list(src.files), "read_only": read_only, "quantize": cfg.quantize,
            "device": cfg.device, "trust_remote_code": cfg.trust_remote_code}


def overrides(cache_dir: Path, offline: bool, own_xet: bool = True) -> dict[str, str]:
    """The environment one load adds; own_xet: xet's chunk cache beside the scenario's cache."""
    return {**({"HF_XET_CACHE": str(cache_dir / ".xet")} if own_xet else {}),
            **({"HF_HUB_OFFLINE": "1"} if offline else {})}


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
