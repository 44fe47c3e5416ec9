"""Fresh vs cached model load, every part timed, a clean process per scenario and repeat; then
what the frame says: medians, advice, the model_cache decision.

`fresh`: an empty HF cache; `cached_offline`: HF_HUB_OFFLINE=1; `cached_cold`: evicted from the
page cache (`cache_state`, `resident` say how far). The parts add up to `load_model`; the `import`
part is the same in every scenario, so it cancels out."""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.config import MODEL_LOAD_SCENARIOS as SCENARIOS
from diag.config import ModelLoadConfig, diag_home
from diag.decision import ADVICE, Decision, MeasuredOn
from diag.machine.disks import disk_kind, evict_page_cache, is_network, resident_fraction
from diag.model_load.processes import LoadProcesses
from diag.noise import MIN_SAMPLES, compare, interleave
from diag.model_load.source import (Source, blob_files, cache_dir_for, failure,
                                    not_in_user_cache, offline_env, open_source, pin_to_cache,
                                    problems, request, snapshot_folder, verify_cache,
                                    weight_files)
from diag.runner import quietly
from diag.secrets import redact
from diag.timing import LOAD_PARTS

if TYPE_CHECKING:
    import pandas as pd

MAX_REPEATS = 8  # budget_s's repeats: enough for the model_cache gap's rank test
COLUMNS = ["scenario", "part", "bytes", "seconds", "mb_per_s", "repeat", "cache_state",
           "resident", "cache_disk", "model", "device", "process", "warning"]


@dataclass(frozen=True)
class ModelLoadResult:
    frame: pd.DataFrame  # one row per scenario x part x repeat (COLUMNS)
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence
    decisions: tuple[Decision, ...] = ()  # model_cache


def verify_model_cache(cfg: ModelLoadConfig, repair: bool = False) -> pd.DataFrame:
    """verify_cache() of cfg's model in its cache; repair re-downloads what failed."""
    cache_dir = cache_dir_for(cfg)
    with open_source(cfg) as src:
        if src.local_dir is not None:
            raise ValueError(f"ModelLoadConfig.model={cfg.model!r} is a local folder: there is "
                             "no HF cache to verify")
        if src.user_cache and not cfg.repair_cache:  # the hub's copy of the cached commit
            src, note = pin_to_cache(src, cache_dir)
            if note:
                warnings.warn(f"model-load: {note}", RuntimeWarning, stacklevel=2)
        return _verify(src, cfg, cache_dir, repair)


def _download(src: Source, cfg: ModelLoadConfig, cache_dir: Path, offline: bool = False) -> dict:
    """src's snapshot into cache_dir, in an interpreter with huggingface_hub only."""
    return LoadProcesses(src.env, "exec", cfg.timeout_s).run(*request(
        src, cfg, cache_dir, "download", offline=offline, own_xet=not src.user_cache))


def _verify(src: Source, cfg: ModelLoadConfig, cache_dir: Path, repair: bool,
            refuse: bool = False) -> pd.DataFrame:
    """verify_cache() of src (repair: re-download what failed); refuse: raise on damage."""
    def fetch() -> None:
        result = _download(src, cfg, cache_dir)
        if "error" in result:
            raise RuntimeError(redact(f"re-downloading {src.model}@{src.revision} after deleting "
                                      f"the damaged files failed: {result['message']}"))

    frame = verify_cache(src.model, cache_dir, src.revision, endpoint=src.endpoint,
                                 redownload=fetch if repair else None)
    if refuse and (bad := problems(frame)):
        whose = "your HF cache (left as it is)" if src.user_cache else "the HF cache"
        raise RuntimeError(redact(
            f"{whose} at {cache_dir} holds a damaged copy of {src.model}@{src.revision}:\n"
            f"{bad}\nnothing was loaded from it; re-download the damaged files with "
            "--repair-cache (diag.model_load.verify_model_cache(cfg, repair=True))"))
    return frame


def _rows(result: dict[str, Any], note: str, **keys: Any) -> list[dict[str, Any]]:
    parts = {"import": {"seconds": result["import_s"], "bytes": 0}, **result["parts"]}
    rows = [{"part": p, **parts[p]} for p in LOAD_PARTS
            if p in parts and (result["quantized"] or p != "quantize")]
    # the load's own clock plus its start-up: the parts' sum checks it, never makes it
    rows.append({"part": "load_model", "bytes": parts["read"]["bytes"],
                 "seconds": result["import_s"] + result["load_s"],
                 "warning": "; ".join(t for t in (note, result["warning"]) if t)})
    return [{**r, **keys, "device": result["device"]} for r in rows]


@quietly
def run_model_load(cfg: ModelLoadConfig | None = None) -> ModelLoadResult:
    """Load cfg.model per scenario, interleaved per repeat, after cfg.warmup unreported loads."""
    import pandas as pd
    from tqdm.auto import tqdm

    cfg, began = cfg or ModelLoadConfig.default(), time.perf_counter()
    cache_dir = cache_dir_for(cfg)
    if offline_env() and "fresh" in cfg.scenarios:
        raise ValueError("ModelLoadConfig.scenarios includes 'fresh', which downloads from the "
                         "hub, but HF_HUB_OFFLINE=1 is set: unset it, or pass --scenarios "
                         "cached,cached_cold")
    rows: list[dict[str, Any]] = []
    with open_source(cfg) as src:
        local = src.local_dir is not None
        cached = not local and snapshot_folder(cache_dir, src.model, src.revision)
        # fresh estimated from cached loads if any; a local folder's fresh, offline: its cached load
        estimate = bool(cfg.estimate_fresh and cached and {"fresh", "cached"} <= set(cfg.scenarios))
        drop = {"fresh", "cached_offline"} if local else {"fresh"} if estimate else set()
        scenarios = [s for s in cfg.scenarios if s not in drop]
        from_cache = any(s != "fresh" for s in scenarios)
        read_only = src.user_cache and not cfg.repair_cache
        if read_only and not cached and from_cache:
            raise not_in_user_cache(src.model, src.revision, cache_dir)
        # every load of the user's cache reads its cached commit
        src, moved = pin_to_cache(src, cache_dir) if read_only and cached else (src, "")
        if cached:
            _verify(src, cfg, cache_dir, cfg.repair_cache, refuse=True)  # before any load
        if not read_only:
            cache_dir.mkdir(parents=True, exist_ok=True)
        disk = disk_kind(src.local_dir or cache_dir)
        scratch = diag_home() if src.user_cache else cache_dir.parent
        scratch.mkdir(parents=True, exist_ok=True)
        if from_cache and not local and not read_only:
            # filled by a process with huggingface_hub only: a wrong id is said before the imports
            got = _download(src, cfg, cache_dir, offline_env())
            if "error" in got:
                raise failure(got, src, cache_dir, cfg.timeout_s)
            if got["parts"]["download"]["bytes"]:
                _verify(src, cfg, cache_dir, cfg.repair_cache, refuse=True)  # what it wrote
        with LoadProcesses(src.env, cfg.process, cfg.timeout_s) as procs:

            def run(job_cache: Path, offline: bool = False, mode: str = "load") -> dict[str, Any]:
                pinned = bool(src.files) and job_cache == cache_dir  # the user's, read only
                result = procs.run(*request(
                    src, cfg, job_cache, mode, pinned, offline or offline_env(),
                    own_xet=job_cache != cache_dir or not src.user_cache))
                if "error" in result:
                    raise failure(result, src, job_cache, cfg.timeout_s)
                return result

            for _ in range(cfg.warmup if from_cache else 0):  # warms the page cache alone
                run(cache_dir, offline=read_only)
            files = (sorted(p for p in src.local_dir.rglob("*") if p.is_file()) if local
                     else blob_files(cache_dir, src.model))
            sizes = [p.stat().st_size for p in files]
            bar = tqdm(total=cfg.repeats * len(scenarios), desc="model load", unit="load",
                       leave=False)

            def measure(scenario: str, repeat: int) -> None:
                bar.total = max(bar.total, (repeat + 1) * len(scenarios))
                if scenario == "fresh":  # on the cache's disk, unless that is the user's HF home
                    with tempfile.TemporaryDirectory(prefix=".diag-fresh-", dir=scratch,
                                                     ignore_cleanup_errors=True) as tmp:
                        result, state, resident = run(Path(tmp)), "fresh download", float("nan")
                else:
                    state = evict_page_cache(files) if scenario == "cached_cold" else "warm"
                    # bytes-weighted share in the page cache: measured, whatever the label says
                    resident = sum(resident_fraction(p) * n for p, n in zip(files, sizes)) / max(
                        sum(sizes), 1) if files else float("nan")
                    if scenario != "cached_cold" and not resident >= 0.98:
                        state = ("warm (unverified)" if resident != resident
                                 else f"partly warm ({resident:.0%} in page cache)")
                    result = run(cache_dir, offline=scenario == "cached_offline")
                rows.extend(_rows(result, moved, scenario=scenario, repeat=repeat,
                                  cache_state=state, resident=resident))
                if scenario == "cached":  # the one call users write; in the user's cache offline
                    # (online, 404s on optional files would leave .no_exist markers there)
                    plain = run(cache_dir, offline=read_only, mode="plain")
                    rows.append({**rows[-1], "part": "from_pretrained", "bytes": 0, "warning": "",
                                 "seconds": plain["seconds"], "device": plain["device"]})
                bar.update()

            def pending(_: Any) -> bool:  # model_cache unmeasured (estimated: too few cached)
                if estimate:
                    return len({r["repeat"] for r in rows if r["scenario"] == "cached"}) \
                        < MIN_SAMPLES
                return decide(pd.DataFrame(rows, columns=COLUMNS))[0].basis != "measured"

            # rounds in a turning order; past cfg.repeats while budget_s allows and it is pending
            more = bool(cfg.budget_s) and {"fresh", "cached"} <= set(cfg.scenarios)
            interleave(scenarios, measure, pending, min_rounds=cfg.repeats,
                       budget_s=max(0.0, cfg.budget_s - (time.perf_counter() - began)),
                       max_rounds=max(cfg.repeats, MAX_REPEATS if more else cfg.repeats))
            bar.close()
        if estimate:  # after the loads: its download warms nothing they read
            rows += _fresh_estimate(src, cache_dir, rows)
    frame = pd.DataFrame(rows, columns=COLUMNS).assign(
        cache_disk=disk, model=src.model, process=cfg.process)
    frame["mb_per_s"] = (frame["bytes"] / frame["seconds"] / 1e6).where(
        (frame["bytes"] > 0) & (frame["seconds"] > 0))
    frame["warning"] = frame["warning"].fillna("")
    for text in sorted(set(frame["warning"]) - {""}):
        warnings.warn(f"model-load: {src.model}: {text}", RuntimeWarning, stacklevel=2)
    return ModelLoadResult(frame, advice(frame), decide(frame))


def _fresh_estimate(src: Source, cache_dir: Path, rows: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """Fresh rows from the cached ones: the model's bytes at one weight file's download rate."""
    from huggingface_hub import hf_hub_download

    folder = snapshot_folder(cache_dir, src.model, src.revision)
    one = min(weight_files(folder), key=lambda p: p.stat().st_size)
    total = sum(p.stat().st_size for p in blob_files(cache_dir, src.model))
    with tempfile.TemporaryDirectory(prefix=".diag-rate-", dir=cache_dir.parent) as tmp:
        start = time.perf_counter()
        size = Path(hf_hub_download(src.model, str(one.relative_to(folder)), cache_dir=tmp,
                                    revision=src.revision, endpoint=src.endpoint or None)
                    ).stat().st_size
        download = total / (size / (time.perf_counter() - start))
    label = (f"estimated: {one.name} ({size / 1e6:.4g} MB) downloaded at "
             f"{total / download / 1e6:.4g} MB/s, for the model's {total / 1e6:.4g} MB")
    cached = [r for r in rows if r["scenario"] == "cached" and r["part"] != "from_pretrained"]
    check = {r["repeat"]: r["seconds"] for r in cached if r["part"] == "download"}
    return [{**r, "scenario": "fresh", "cache_state": label, "resident": float("nan"),
             "bytes": total if r["part"] == "download" else r["bytes"],
             "seconds": {"download": download, "load_model": r["seconds"] + download
                         - check.get(r["repeat"], 0.0)}.get(r["part"], r["seconds"])}
            for r in cached]


def medians(frame: pd.DataFrame) -> pd.DataFrame:
    """Median seconds per scenario (rows) and part (columns), load_model last."""
    table = frame.pivot_table(index="scenario", columns="part", values="seconds", aggfunc="median")
    order = [p for p in (*LOAD_PARTS, "load_model", "from_pretrained") if p in table.columns]
    return table.reindex(index=[s for s in SCENARIOS if s in table.index], columns=order)


def advice(frame: pd.DataFrame) -> pd.DataFrame:
    """Advice rows (stage, finding, seconds_saved, evidence) for amdahl.findings(advice=...)."""
    import pandas as pd

    if frame.empty:
        return pd.DataFrame(columns=ADVICE)
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
        add("Keep the HF cache (HF_HUB_CACHE, default HF_HOME/hub) on a persistent local NVMe "
            "volume, so each run loads the model from disk instead of downloading it; where a "
            "download can't be avoided, HF_XET_HIGH_PERFORMANCE=1 lets hf_xet use every core and "
            "more bandwidth for Xet-stored repos (the embedded hub serves no Xet: not measured)",
            med.loc["fresh", "load_model"] - med.loc["cached", "load_model"],
            f"{load('fresh')} (download {got['bytes'].median() / 1e6:.4g} MB at "
            f"{got['mb_per_s'].median():.4g} MB/s) vs {load('cached')}")
    if {"cached", "cached_offline"} <= set(med.index):
        add("Set HF_HUB_OFFLINE=1 once the model is cached: no revision check against the hub",
            med.loc["cached", "download"] - med.loc["cached_offline", "download"],
            f"cached download (revision check) median {med.loc['cached', 'download']:.3g} s "
            f"vs cached_offline {med.loc['cached_offline', 'download']:.3g} s")
    cold = frame[frame.scenario == "cached_cold"]
    if ("cached" in med.index and not cold.empty
            and cold["cache_state"].str.startswith("cold").all()):
        add("Keep the model in the page cache between runs (same machine, enough free RAM): "
            "a cold read comes from the disk",
            med.loc["cached_cold", "load_model"] - med.loc["cached", "load_model"],
            f"{load('cached_cold')} (read {med.loc['cached_cold', 'read']:.3g} s) vs "
            f"{load('cached')} (read {med.loc['cached', 'read']:.3g} s)")
        if frame["cache_disk"].map(is_network).any():
            read = cold[cold.part == "read"].median(numeric_only=True)
            add("The HF cache is on network storage: every cold load reads it at network speed; "
                "put HF_HUB_CACHE on local NVMe (an upper bound)", float(read["seconds"]),
                f"cached_cold read median {read['seconds']:.3g} s at {read['mb_per_s']:.4g} MB/s "
                "from a network filesystem")
    return pd.DataFrame(rows, columns=ADVICE)


def decide(frame: pd.DataFrame | None) -> tuple[Decision, ...]:
    """`model_cache`: "persistent" unless fresh loads (less their import) resolve faster."""
    fresh, cached = _loads(frame, "fresh"), _loads(frame, "cached")
    if not fresh or not cached:
        why = ("model_load frame absent" if frame is None or frame.empty else
               "no fresh or cached load_model row ran")
        return (Decision.default("model_cache", "persistent",
                                 f"{why}: keep a persistent HF cache", source="model_load"),)
    rows = frame[frame["scenario"].isin(["fresh", "cached"])
                 & frame["part"].isin(["load_model", "import"])]
    gap = compare(cached, fresh)
    choice = {"a": "persistent", "b": "empty"}.get(gap.faster or "", "persistent")
    imported = float(frame.loc[frame["part"] == "import", "seconds"].median())
    model = str(frame["model"].iloc[0]) if "model" in frame.columns else ""
    device = str(frame["device"].dropna().iloc[0]) if frame["device"].notna().any() else ""
    cached_s, fresh_s = statistics.median(cached), statistics.median(fresh)
    return (Decision.from_rows(
        "model_cache", choice, f"cached load {cached_s:.3g} s vs fresh {fresh_s:.3g} s per "
        f"start, the import ({imported:.3g} s, paid by both) apart: {gap.describe()} -> "
        f"{choice}" + ("" if gap.resolved else " (the default)"), rows, source="model_load",
        basis="measured" if gap.resolved else "default",
        measured_on=MeasuredOn(model=model, precision="nf4", device=device,
                               step="a load process's model load (download, read, quantize, "
                                    "to device, tokenizer), its import apart"),
        baseline="empty", stage="load_model", per="start", baseline_s=fresh_s,
        chosen_s=cached_s if choice == "persistent" else fresh_s,
        **(gap if choice == "persistent" else compare(fresh, cached)).sure()),)


def _loads(frame: pd.DataFrame | None, scenario: str) -> list[float]:
    """Each repeat's load_model seconds less its import ([] if none ran)."""
    if frame is None or frame.empty:
        return []
    rows = frame[frame["scenario"] == scenario]
    loads = rows.loc[rows["part"] == "load_model", "seconds"].to_numpy(float)
    imports = rows.loc[rows["part"] == "import", "seconds"].to_numpy(float)
    return [float(s) for s in (loads - imports if len(imports) == len(loads) else loads)]
