"""Fresh vs cached model load, every part timed: what a job pays to get its base model on the device.

`run_model_load(cfg)` loads the model in a fresh process per scenario and repeat: `fresh` (an
empty temporary HF cache: the full download), `cached` (the persistent cache, page cache warm),
`cached_offline` (the same with HF_HUB_OFFLINE=1: no revision check), `cached_cold` (the files
evicted from the page cache; `cache_state` says whether that worked). Parts `download`, `read`,
`quantize`, `to_device`, `tokenizer` add up to the `load_model` row; `model_advice()` turns the
medians into what a persistent cache, offline mode and a warm page cache save per run.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.config import MODEL_LOAD_SCENARIOS as SCENARIOS
from diag.config import ModelLoadConfig, diag_home
from diag.model_load import hfcache
from diag.model_load.worker import run_worker
from diag.secrets import redact
from diag.timing import LOAD_PARTS

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = ["scenario", "part", "bytes", "seconds", "mb_per_s", "repeat", "cache_state",
           "cache_disk", "model", "device"]
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Source:
    """Where the model comes from and what a load process needs to reach it."""

    model: str  # the repo id, or the local folder
    revision: str
    endpoint: str  # "" for a local folder
    local_dir: Path | None
    env: dict[str, str]


def cache_dir_for(cfg: ModelLoadConfig) -> Path:
    """The persistent HF hub cache of the cached scenarios (never HF_HOME unless named)."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else diag_home() / "hf-cache"


@contextlib.contextmanager
def open_source(cfg: ModelLoadConfig) -> Iterator[Source]:
    """The embedded hub (started here, stopped after), a hub id, or a local folder."""
    base = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    if not cfg.model:
        from diag.embedded import HubServer, ensure_assets

        assets = ensure_assets()
        with HubServer(assets.hub_root) as hub:
            yield Source(assets.repo_id, cfg.revision, hub.endpoint, None,
                         {**base, **hub.env()})
        return
    folder = Path(cfg.model).expanduser()
    if folder.is_dir():
        hfcache.weight_files(folder)  # refuse pickle-only folders before any process starts
        yield Source(str(folder.resolve()), "", "", folder.resolve(), base)
        return
    if cfg.model.startswith(("/", ".", "~")) or cfg.model.count("/") > 1:
        raise ValueError(f"ModelLoadConfig.model={cfg.model!r}: no such folder, and not a hub "
                         "id ('org/name'); allowed: '' (embedded model), a hub id, a folder")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    yield Source(cfg.model, cfg.revision, endpoint, None, base)


def _job(src: Source, cfg: ModelLoadConfig, cache_dir: Path, mode: str = "load") -> dict[str, Any]:
    return {"mode": mode, "model": src.model, "revision": src.revision or "main",
            "cache_dir": str(cache_dir), "local_dir": str(src.local_dir or ""),
            "quantize": cfg.quantize, "device": cfg.device,
            "trust_remote_code": cfg.trust_remote_code}


def _env(src: Source, cache_dir: Path, offline: bool) -> dict[str, str]:
    # xet's chunk cache would make a "fresh" download partly local, and lives in HF_HOME:
    # keep it beside the scenario's cache, so fresh is fresh and HF_HOME is left alone
    env = {**src.env, "HF_XET_CACHE": str(cache_dir / ".xet")}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _fail(result: dict[str, Any], src: Source, cache_dir: Path) -> RuntimeError:
    """The error a user reads: what failed, where, and what to do."""
    kind, what = result["error"], f"{src.model}@{src.revision or 'main'}"
    warm = (f"warm the cache once with network access: python -m diag model-load --model "
            f"{src.model} --cache-dir {cache_dir} --scenarios cached (or: hf download "
            f"{src.model} --cache-dir {cache_dir}), then run offline")
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
    }
    text = texts.get(kind, f"loading {what} failed: {result['type']}: {result['message']}")
    return RuntimeError(redact(text))


def verify_model_cache(cfg: ModelLoadConfig, repair: bool = False) -> pd.DataFrame:
    """verify_cache() for cfg's model in cfg's persistent cache; repair re-downloads bad files."""
    cache_dir = cache_dir_for(cfg)
    with open_source(cfg) as src:
        if src.local_dir is not None:
            raise ValueError(f"ModelLoadConfig.model={cfg.model!r} is a local folder: there is "
                             "no HF cache to verify")
        return hfcache.verify_cache(src.model, cache_dir, src.revision,
                                    redownload=_redownload(src, cfg, cache_dir) if repair else None)


def _redownload(src: Source, cfg: ModelLoadConfig, cache_dir: Path) -> Callable[[], None]:
    """Download src's snapshot into cache_dir again, in a load process (after a repair deleted
    the damaged files)."""

    def fetch() -> None:
        result = run_worker(_job(src, cfg, cache_dir, mode="download"),
                            _env(src, cache_dir, offline=False), cfg.timeout_s)
        if "error" in result:
            raise RuntimeError(redact(f"re-downloading {src.model}@{src.revision} after deleting "
                                      f"the damaged files failed: {result['message']}"))

    return fetch


def _check_cache(src: Source, cfg: ModelLoadConfig, cache_dir: Path) -> None:
    """Never load a cached blob whose content fails its checksum (or a partial download)."""
    frame = hfcache.verify_cache(
        src.model, cache_dir, src.revision,
        redownload=_redownload(src, cfg, cache_dir) if cfg.repair_cache else None)
    bad = hfcache.problems(frame)
    if bad:
        raise RuntimeError(redact(
            f"the HF cache at {cache_dir} holds a damaged copy of {src.model}@{src.revision}:\n"
            f"{bad}\nnothing was loaded from it; re-download the damaged files with "
            "--repair-cache (diag.model_load.verify_model_cache(cfg, repair=True))"))


def _page_state(files: list[Path]) -> str:
    from diag.disks import resident_fraction

    fractions = [f for f in (resident_fraction(p) for p in files) if not math.isnan(f)]
    if not fractions:
        return "warm (unverified)"
    low = min(fractions)
    return "warm" if low >= 0.98 else f"partly warm ({low:.0%} in page cache)"


def _rows(result: dict[str, Any], scenario: str, repeat: int, state: str, disk: str,
          src: Source, quantize: bool) -> list[dict[str, Any]]:
    parts = [p for p in LOAD_PARTS if quantize or p != "quantize"]
    rows = []
    for part in parts:
        seconds, nbytes = result["parts"][part]["seconds"], result["parts"][part]["bytes"]
        rows.append({"part": part, "bytes": nbytes, "seconds": seconds})
    total = sum(r["seconds"] for r in rows)  # the parts ran back to back: their sum is the load
    rows.append({"part": "load_model", "bytes": result["parts"]["read"]["bytes"], "seconds": total})
    for r in rows:
        r.update(scenario=scenario, repeat=repeat, cache_state=state, cache_disk=disk,
                 model=src.model, device=result["device"],
                 mb_per_s=r["bytes"] / r["seconds"] / 1e6 if r["bytes"] and r["seconds"] > 0
                 else float("nan"))
    return rows


def run_model_load(cfg: ModelLoadConfig | None = None) -> pd.DataFrame:
    """Load cfg.model in each scenario, cfg.repeats times after one warm-up; the tidy frame.

    Scenarios run interleaved per repeat, so drift hits each alike. The warm-up (not reported)
    fills the persistent cache, which is verified by checksum before and after it.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from diag.disks import disk_kind, evict_page_cache

    cfg = cfg or ModelLoadConfig.default()
    cache_dir = cache_dir_for(cfg)
    offline_env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    if offline_env and "fresh" in cfg.scenarios:
        raise ValueError("ModelLoadConfig.scenarios includes 'fresh', which downloads from the "
                         "hub, but HF_HUB_OFFLINE=1 is set: unset it, or pass --scenarios "
                         "cached,cached_cold")
    rows: list[dict[str, Any]] = []
    with open_source(cfg) as src:
        local = src.local_dir is not None
        # a local folder has nothing to download: fresh and offline would measure the same load
        scenarios = [s for s in cfg.scenarios if not (local and s in ("fresh", "cached_offline"))]
        cache_dir.mkdir(parents=True, exist_ok=True)
        disk = disk_kind(src.local_dir or cache_dir)
        run = lambda job_cache, offline=False: run_worker(
            _job(src, cfg, job_cache), _env(src, job_cache, offline or offline_env), cfg.timeout_s)
        if any(s != "fresh" for s in scenarios):
            if not local and hfcache.snapshot_folder(cache_dir, src.model, src.revision):
                _check_cache(src, cfg, cache_dir)
            warm = run(cache_dir)
            if "error" in warm:
                raise _fail(warm, src, cache_dir)
            if not local and warm["parts"]["download"]["bytes"]:
                _check_cache(src, cfg, cache_dir)  # the warm-up just downloaded it: check it
        files = (sorted(p for p in src.local_dir.rglob("*") if p.is_file()) if local
                 else hfcache.blob_files(cache_dir, src.model))
        plan = [(r, s) for r in range(cfg.repeats) for s in scenarios]
        for repeat, scenario in tqdm(plan, desc="model load", unit="load", leave=False):
            if scenario == "fresh":
                tmp = Path(tempfile.mkdtemp(prefix=".diag-fresh-", dir=cache_dir.parent))
                try:
                    result, state = run(tmp), "fresh download"
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            else:
                state = evict_page_cache(files) if scenario == "cached_cold" else _page_state(files)
                result = run(cache_dir, offline=scenario == "cached_offline")
            if "error" in result:
                raise _fail(result, src, cache_dir)
            rows += _rows(result, scenario, repeat, state, disk, src, cfg.quantize)
    return pd.DataFrame(rows, columns=COLUMNS)


def medians(frame: pd.DataFrame) -> pd.DataFrame:
    """Median seconds per scenario (rows) and part (columns), load_model last."""
    table = frame.pivot_table(index="scenario", columns="part", values="seconds", aggfunc="median")
    order = [p for p in (*LOAD_PARTS, "load_model") if p in table.columns]
    return table.reindex(index=[s for s in SCENARIOS if s in table.index], columns=order)


def advice(frame: pd.DataFrame) -> pd.DataFrame:
    """Advice rows (stage, finding, seconds_saved, evidence) for amdahl.findings(extra=...)."""
    import pandas as pd

    cols = ["stage", "finding", "seconds_saved", "evidence"]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    med, rows = medians(frame), []
    runs = frame.groupby("scenario")["repeat"].nunique()

    def load(s: str) -> str:
        return f"{s} load_model median {med.loc[s, 'load_model']:.3g} s over {runs[s]} runs"

    def add(finding: str, saved: float, evidence: str) -> None:
        if saved > 0:
            rows.append({"stage": "load_model", "finding": finding, "seconds_saved": saved,
                         "evidence": f"model_load: {evidence}"})

    if {"fresh", "cached"} <= set(med.index):
        got = frame[(frame.scenario == "fresh") & (frame.part == "download")]
        add("Keep the HF cache (HF_HOME) on a persistent local NVMe volume, so each run loads "
            "the model from disk instead of downloading it",
            med.loc["fresh", "load_model"] - med.loc["cached", "load_model"],
            f"{load('fresh')} (download {got['bytes'].median() / 1e6:.4g} MB at "
            f"{got['mb_per_s'].median():.4g} MB/s) vs {load('cached')}")
    if {"cached", "cached_offline"} <= set(med.index):
        add("Set HF_HUB_OFFLINE=1 once the model is cached: no revision check against the hub",
            med.loc["cached", "download"] - med.loc["cached_offline", "download"],
            f"cached download (revision check) median {med.loc['cached', 'download']:.3g} s "
            f"vs cached_offline {med.loc['cached_offline', 'download']:.3g} s")
    cold = frame[frame.scenario == "cached_cold"]
    if "cached" in med.index and not cold.empty and cold["cache_state"].str.startswith("cold").all():
        add("Keep the model in the page cache between runs (same machine, enough free RAM): "
            "a cold read comes from the disk",
            med.loc["cached_cold", "load_model"] - med.loc["cached", "load_model"],
            f"{load('cached_cold')} (read {med.loc['cached_cold', 'read']:.3g} s) vs "
            f"{load('cached')} (read {med.loc['cached', 'read']:.3g} s)")
        if (frame["cache_disk"] == "network").any():
            read = cold[cold.part == "read"]
            rows.append({"stage": "load_model", "seconds_saved": float(read["seconds"].median()),
                         "finding": "The HF cache is on network storage: every cold load reads "
                         "it at network speed; put HF_HOME on local NVMe (an upper bound)",
                         "evidence": f"model_load: cached_cold read median "
                         f"{read['seconds'].median():.3g} s at {read['mb_per_s'].median():.4g} "
                         "MB/s from a network filesystem"})
    return pd.DataFrame(rows, columns=cols)
