"""Does diag's split of a model load cost anything, read anything twice, or hide a start-up cost?

One run, on the embedded tiny model and the ~420 MB "small" model, page cache warm:
- diag's cached `read` part vs safetensors' own `load_file` (+ clone: load_file alone maps the
  file lazily and reads nothing) of the same files; ratio raw/diag, goal >= 0.9 (small model);
- diag's fresh `load_model` vs a raw `snapshot_download` into an empty cache plus diag's cached
  `load_model` (1.0 when the fresh path reads nothing twice); diag's read + quantize + to_device
  beside the one plain `from_pretrained(repo, quantization_config=...)` call (the cross-check row);
- fork vs exec: the tiny model's cached_offline load measured with loads forked from the zygote
  and with a fresh interpreter per load; the relative difference of load_model (import included)
  must stay within 10%, so the zygote hides nothing a new job pays.
The small model runs fresh and cached only (what its goal lines need): each load quantizes 420 MB.
Raw measurements run in processes forked from their own zygote, exactly like diag's loads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.config import ModelLoadConfig, diag_home
from diag.embedded import HubServer, ensure_assets
from diag.model_load import SCENARIOS, medians, run_model_load, snapshot_folder, weight_files
from diag.model_load.processes import LoadProcesses


def raw_rounds(procs: LoadProcesses, repo: str, cache: Path, rounds: int) -> tuple[list, list]:
    """Per round: safetensors' read of the cached files; snapshot_download into an empty cache."""
    folder = snapshot_folder(cache, repo)
    files = [str(p) for p in weight_files(folder)]
    reads, downloads = [], []
    for _ in range(rounds):
        reads.append(procs.run({"mode": "raw_read", "files": files})["seconds"])
        tmp = tempfile.mkdtemp(prefix=".bench-fresh-", dir=cache.parent)
        try:
            got = procs.run({"mode": "download", "model": repo, "revision": "main",
                             "cache_dir": tmp, "local_dir": ""}, {"HF_XET_CACHE": tmp + "/.xet"})
            downloads.append(got["parts"]["download"]["seconds"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return reads, downloads


def bench(size: str, rounds: int, procs: LoadProcesses, scenarios: list[str]) -> tuple:
    assets = ensure_assets(model=size)
    cache = diag_home() / "bench-hf-cache"
    cfg = ModelLoadConfig(model=assets.repo_id, repeats=rounds, cache_dir=str(cache), device="cpu",
                          scenarios=scenarios)
    frame = run_model_load(cfg).frame  # fills the cache the raw read needs
    reads, downloads = raw_rounds(procs, assets.repo_id, cache, rounds)
    med = medians(frame)
    mb = frame[frame.part == "read"]["bytes"].iloc[0] / 1e6
    diag_read, raw_read, download = med.loc["cached", "read"], statistics.median(reads), \
        statistics.median(downloads)
    loads = med["load_model"] - med["import"]  # the per-load figures; import is per job start
    fresh_ratio = loads["fresh"] / (download + loads["cached"])
    split = med.loc["cached", ["download", "read", "quantize", "to_device"]].sum()
    plain = med.loc["cached", "from_pretrained"]
    print(f"\n[{size}] {assets.repo_id}: {mb:.1f} MB of weights, {rounds} repeats, medians (s):")
    print(med.round(4).to_string())
    print(f"[{size}] raw load_file {raw_read:.4f} s vs diag read {diag_read:.4f} s: ratio "
          f"raw/diag {raw_read / diag_read:.3f} (higher is better)")
    print(f"[{size}] fresh load {loads['fresh']:.3f} s vs raw download {download:.3f} s + cached "
          f"load {loads['cached']:.3f} s: ratio {fresh_ratio:.3f} (1.0 = nothing read twice)")
    print(f"[{size}] diag download+read+quantize+to_device {split:.3f} s vs one from_pretrained "
          f"call {plain:.3f} s: ratio {plain / split:.3f}")
    return raw_read / diag_read, cfg, med


def fork_vs_exec(cfg: ModelLoadConfig, fork: pd.Series) -> float:
    """cached_offline load_model forked (from bench()'s run) vs exec'd: relative difference."""
    # the fork run just warmed the page cache and the files: no warm-up needed here
    frame = run_model_load(cfg.replace(process="exec", scenarios=["cached_offline"],
                                       warmup=0)).frame
    got = {"fork": fork, "exec": medians(frame).loc["cached_offline"]}
    for process, med in got.items():
        print(f"[fork vs exec] {process}: load_model {med['load_model']:.3f} s = import "
              f"{med['import']:.3f} s + load {med['load_model'] - med['import']:.3f} s "
              f"(medians of {cfg.repeats})")
    per_load = [got[p]["load_model"] - got[p]["import"] for p in ("fork", "exec")]
    print(f"[fork vs exec] per load without import: fork/exec {per_load[0] / per_load[1]:.3f}")
    return abs(got["fork"]["load_model"] / got["exec"]["load_model"] - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="repeats per model and scenario")
    args = parser.parse_args()
    started = time.perf_counter()
    with HubServer(ensure_assets().hub_root) as hub:  # one hub root serves both sizes
        os.environ["HF_ENDPOINT"] = hub.endpoint  # run_model_load passes it to its processes
        env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        ensure_assets(model="small")
        with LoadProcesses(env) as raw:
            _, tiny, med = bench("tiny", args.rounds, raw, list(SCENARIOS))
            diff = fork_vs_exec(tiny, med.loc["cached_offline"])
            # small: the two scenarios its goal lines need (each load quantizes 420 MB on CPU)
            ratio, _, _ = bench("small", args.rounds, raw, ["fresh", "cached"])
    print(f"\nwall time {time.perf_counter() - started:.1f} s")
    print(f"model_load_fork_vs_exec: {diff:.3f} (goal <= 0.1)")
    print(f"model_load_read: {ratio:.3f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
