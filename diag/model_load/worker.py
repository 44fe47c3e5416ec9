"""One timed model load in a fresh process: what a training job pays between start and step 1.

`run_worker(job, env)` starts `python -m diag.model_load.worker JOB` (huggingface_hub reads HF_ENDPOINT
and HF_HUB_OFFLINE once, at import, and a real job is a fresh process too) and returns the JSON
it prints: each part's seconds and bytes, or an error kind the caller turns into a clear message.
Interpreter start and library imports are not timed: they cost the same whatever the cache holds.
The parts run back to back, so they add up to the load: see `_load` for what each one is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from diag.secrets import redact

MARK = "DIAG-LOAD-RESULT "  # prefix of the one stdout line the parent parses
# What a causal-LM load needs; never pickle weights (*.bin, *.pt, *.pth can run code when loaded)
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "tokenizer*", "*.model", "*.tiktoken",
                  "*.txt", "*.jinja"]
_PKG_PARENT = str(Path(__file__).resolve().parents[2])


def run_worker(job: dict[str, Any], env: dict[str, str], timeout_s: float = 1800.0
               ) -> dict[str, Any]:
    """Run one job in a fresh interpreter; return its result dict (it may hold "error")."""
    env = {**env, "PYTHONPATH": os.pathsep.join(
        p for p in (_PKG_PARENT, env.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([sys.executable, "-m", "diag.model_load.worker", json.dumps(job)],
                              capture_output=True, text=True, env=env, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False)  # no prompt: trust_remote_code
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"loading {job.get('model')!r} took longer than timeout_s="
                           f"{timeout_s:g} s; raise --timeout-s for a large model on a slow link"
                           ) from None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = redact((done.stderr or done.stdout)[-3000:])
    raise RuntimeError(f"the model-load process exited with code {done.returncode} and no "
                       f"result; its last output:\n{tail}")


# -- inside the worker process ------------------------------------------------------------------
def _blob_bytes(cache_dir: str) -> int:
    return sum(p.stat().st_size for p in Path(cache_dir).glob("models--*/blobs/*")
               if not p.name.endswith(".incomplete"))


def _download(job: dict[str, Any]) -> tuple[Path, int]:
    """The snapshot folder, and the bytes this call wrote into the cache."""
    if job.get("local_dir"):
        return Path(job["local_dir"]), 0
    from huggingface_hub import snapshot_download  # imported untimed by main() already

    before = _blob_bytes(job["cache_dir"])
    folder = snapshot_download(job["model"], revision=job["revision"],
                               cache_dir=job["cache_dir"], allow_patterns=ALLOW_PATTERNS)
    return Path(folder), _blob_bytes(job["cache_dir"]) - before


def _load(job: dict[str, Any]) -> dict[str, Any]:
    """Time the parts back to back; each starts where the previous one stopped.

    download  snapshot_download into the job's cache (a revision check when already cached);
    read      safetensors.torch.load_file of the weight files, copied into host memory;
    quantize  time inside bitsandbytes' quantize_4bit during from_pretrained (device-synced);
    to_device the rest of from_pretrained(state_dict=...): model skeleton, dtype casts, copies
              to the device, dispatch. from_pretrained gets the tensors `read` made, so no file
              is read twice; tokenizer: AutoTokenizer.from_pretrained on the snapshot folder.
    """
    from diag.model_load.hfcache import weight_files

    perf = time.perf_counter
    untimed_s = perf() - job["_started"]
    t0 = perf()
    folder, downloaded = _download(job)
    download_s = perf() - t0
    weights = weight_files(folder)  # raises if there are only pickle weights: never loaded

    # untimed: the library imports a job pays once per process whatever the cache state
    u0 = perf()
    import safetensors.torch
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        BitsAndBytesConfig,
    )

    from diag.device import resolve, sync

    device = str(resolve(job["device"]))
    trust = bool(job["trust_remote_code"])
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust)
    model_class = _model_class(AutoModelForCausalLM, config, folder, trust)
    quantized = {"seconds": 0.0, "bytes": 0}
    if job["quantize"]:
        import bitsandbytes.functional as bnb_functional

        real_quantize = bnb_functional.quantize_4bit

        def timed_quantize(A: Any, *args: Any, **kwargs: Any) -> Any:
            sync(device)  # note: CPU-GPU sync point, so the copy queued before is not billed here
            start = perf()
            out = real_quantize(A, *args, **kwargs)
            sync(device)  # note: CPU-GPU sync point, so the quantize kernel is billed here
            quantized["seconds"] += perf() - start
            quantized["bytes"] += A.numel() * A.element_size()
            return out

        # Params4bit._quantize looks the function up on the module at each call
        bnb_functional.quantize_4bit = timed_quantize
    untimed_s += perf() - u0

    t1 = perf()
    state = {}
    for path in weights:
        # load_file maps the file lazily: clone() makes the bytes really arrive in host memory
        # here, so a cold disk read is billed to read, not to the first op that touches them
        state.update((k, v.clone()) for k, v in
                     safetensors.torch.load_file(path, device="cpu").items())
    t2 = perf()
    kwargs: dict[str, Any] = {"device_map": {"": device}, "trust_remote_code": trust}
    if job["quantize"]:
        compute = torch.bfloat16 if device == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    else:
        kwargs["dtype"] = "auto"
    model = model_class.from_pretrained(None, config=config, state_dict=state, **kwargs)
    sync(device)  # note: CPU-GPU sync point, so queued copies are billed to to_device
    t3 = perf()
    AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    t4 = perf()
    del state
    weight_bytes = sum(p.stat().st_size for p in weights)
    token_bytes = sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("tokenizer"))
    return {
        "snapshot": str(folder), "device": device, "untimed_s": untimed_s,
        "quantized": bool(job["quantize"]),
        "parts": {
            "download": {"seconds": download_s, "bytes": downloaded},
            "read": {"seconds": t2 - t1, "bytes": weight_bytes},
            "quantize": {"seconds": quantized["seconds"], "bytes": quantized["bytes"]},
            "to_device": {"seconds": (t3 - t2) - quantized["seconds"],
                          "bytes": int(model.get_memory_footprint())},
            "tokenizer": {"seconds": t4 - t3, "bytes": token_bytes},
        },
    }


def _model_class(auto: Any, config: Any, folder: Path, trust: bool) -> Any:
    """The class AutoModelForCausalLM would pick (importing its module here, untimed)."""
    try:
        return auto._model_mapping[type(config)]
    except KeyError:
        ref = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
        if not (trust and ref):
            raise ValueError(f"{type(config).__name__} has no causal-LM class in transformers; "
                             "a model with its own code needs trust_remote_code=True") from None
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(ref, str(folder))


def _error_kind(err: BaseException) -> str:
    from huggingface_hub import errors

    if isinstance(err, errors.RevisionNotFoundError):
        return "revision_not_found"
    if isinstance(err, errors.RepositoryNotFoundError):
        return "repo_not_found"
    if isinstance(err, errors.LocalEntryNotFoundError):
        from huggingface_hub import constants

        return "offline_not_cached" if constants.HF_HUB_OFFLINE else "unreachable_not_cached"
    if "trust_remote_code" in str(err):
        return "remote_code"
    return "other"


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    job["_started"] = time.perf_counter()
    try:
        from huggingface_hub import snapshot_download  # noqa: F401  untimed: process start cost
        if job["mode"] == "download":
            t0 = time.perf_counter()
            folder, downloaded = _download(job)
            result = {"snapshot": str(folder), "parts": {"download": {
                "seconds": time.perf_counter() - t0, "bytes": downloaded}}}
        else:
            result = _load(job)
    except (OSError, ValueError, RuntimeError, KeyError, ImportError) as err:
        # every failure is reported as data: the parent owns the message the user sees
        kind = "no_safetensors" if isinstance(err, ValueError) and "safetensors" in str(err) \
            else _error_kind(err)
        result = {"error": kind, "type": type(err).__name__, "message": redact(str(err))[-2000:]}
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
