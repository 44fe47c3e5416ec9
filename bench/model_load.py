"""Does diag's split of a model load cost anything, and does the fresh path read anything twice?

Side by side in one run, alternating order per round, on the embedded tiny model and the ~420 MB
"small" model: diag's cached `read` part vs a raw `safetensors.torch.load_file` (+ clone: load_file alone maps
the file lazily and reads nothing) of the same files, each in a fresh process, page cache warm;
ratio raw/diag, higher is better, goal >= 0.9; and
diag's fresh `load_model` vs a raw `snapshot_download` into an empty cache plus diag's cached
`load_model` (~1.0 when the fresh path reads nothing twice). Also printed: diag's read + quantize
+ to_device vs one plain `from_pretrained(folder, quantization_config=...)` call.
Last line: `model_load_read: <ratio> (goal >= 0.9)` for the small model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.model_load import hfcache
from diag.config import ModelLoadConfig, diag_home
from diag.model_load.worker import ALLOW_PATTERNS
from diag.embedded import HubServer, ensure_assets
from diag.model_load import medians, run_model_load

# Each raw measurement runs in a fresh process like diag's, imports untimed, one JSON line out.
RAW = r"""
import json, sys, time
job = json.loads(sys.argv[1])
if job["what"] == "download":
    from huggingface_hub import snapshot_download
    t = time.perf_counter()
    snapshot_download(job["repo"], cache_dir=job["cache"], allow_patterns=job["patterns"])
else:
    import safetensors.torch, torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig
    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(job["folder"]))]
    t = time.perf_counter()
    if job["what"] == "read":
        for f in job["files"]:  # the same copy into host memory diag's read makes
            {k: v.clone() for k, v in safetensors.torch.load_file(f).items()}
    else:
        AutoModelForCausalLM.from_pretrained(job["folder"], device_map={"": "cpu"},
            use_safetensors=True, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
            bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
print("RAW", json.dumps(time.perf_counter() - t))
"""


def raw(job: dict, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", RAW, json.dumps(job)], capture_output=True,
                         text=True, env=env, check=True).stdout
    return json.loads(next(x for x in out.splitlines() if x.startswith("RAW "))[4:])


def bench(size: str, rounds: int) -> float:
    assets = ensure_assets(model=size)
    cache = diag_home() / "bench-hf-cache"
    cfg = ModelLoadConfig(model=assets.repo_id, repeats=1, cache_dir=str(cache), device="cpu")
    diag_runs, reads, downloads, one_call = [], [], [], []
    with HubServer(assets.hub_root) as hub:
        os.environ["HF_ENDPOINT"] = hub.endpoint  # run_model_load passes it to its processes
        env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}

        def raw_round() -> None:
            folder = hfcache.snapshot_folder(cache, assets.repo_id)
            files = [str(p) for p in hfcache.weight_files(folder)]
            reads.append(raw({"what": "read", "files": files, "folder": str(folder)}, env))
            one_call.append(raw({"what": "from_pretrained", "folder": str(folder)}, env))
            tmp = tempfile.mkdtemp(prefix=".bench-fresh-", dir=cache.parent)
            try:
                downloads.append(raw({"what": "download", "repo": assets.repo_id, "cache": tmp,
                                      "patterns": ALLOW_PATTERNS}, env))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

        for i in range(rounds):
            steps = [lambda: diag_runs.append(run_model_load(cfg.replace())), raw_round]
            for step in steps if i % 2 == 0 else steps[::-1]:
                step()
    import pandas as pd

    frame = pd.concat([f.assign(repeat=i) for i, f in enumerate(diag_runs)], ignore_index=True)
    med = medians(frame)
    mb = frame[frame.part == "read"]["bytes"].iloc[0] / 1e6
    diag_read = med.loc["cached", "read"]
    read_ratio = statistics.median(reads) / diag_read
    fresh_ratio = med.loc["fresh", "load_model"] / (statistics.median(downloads)
                                                     + med.loc["cached", "load_model"])
    split = med.loc["cached", ["read", "quantize", "to_device"]].sum()
    print(f"\n[{size}] {assets.repo_id}: {mb:.1f} MB of weights, {rounds} rounds, medians (s):")
    print(med.round(4).to_string())
    print(f"[{size}] raw load_file {statistics.median(reads):.4f} s vs diag read {diag_read:.4f} "
          f"s: ratio raw/diag {read_ratio:.3f} (higher is better)")
    print(f"[{size}] fresh load_model {med.loc['fresh', 'load_model']:.3f} s vs raw download "
          f"{statistics.median(downloads):.3f} s + cached load_model "
          f"{med.loc['cached', 'load_model']:.3f} s: ratio {fresh_ratio:.3f} (1.0 = nothing read "
          "twice)")
    print(f"[{size}] diag read+quantize+to_device {split:.3f} s vs one from_pretrained call "
          f"{statistics.median(one_call):.3f} s: ratio {statistics.median(one_call) / split:.3f}")
    return read_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per model")
    args = parser.parse_args()
    bench("tiny", args.rounds)
    ratio = bench("small", args.rounds)
    print(f"model_load_read: {ratio:.3f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
