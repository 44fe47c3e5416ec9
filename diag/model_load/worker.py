"""What runs in a load process: one timed model load, as a training job does it before step 1.

`python -m diag.model_load.worker JOB` runs one job in this fresh interpreter, or (mode "zygote")
imports once and forks a clean child per job line on stdin; each reply is one JSON line on stdout:
each part's seconds and bytes, `load_s` (one clock around all) and `import_s`, or an error kind."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from diag.embedded.servers import die_with_parent
from diag.model_load.source import ALLOW_PATTERNS, blob_files, weight_files
from diag.secrets import redact


def import_libraries(with_cuda_libraries: bool = True) -> None:
    """The `import` part; a zygote leaves out bitsandbytes, whose import initialises CUDA."""
    import safetensors.torch  # noqa: F401
    import torch
    from huggingface_hub import snapshot_download  # noqa: F401
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer,  # noqa: F401
                              BitsAndBytesConfig, modeling_utils)  # (this one is lazy otherwise)

    # fork-safe: the parent sets PYTORCH_NVML_BASED_CUDA_CHECK=1
    if with_cuda_libraries or not torch.cuda.is_available():
        import bitsandbytes.functional  # noqa: F401


def crashed(why: str, output: str) -> dict[str, Any]:
    """The result of a load process that ended with no result: why, and its output's tail."""
    return {"error": "crashed", "type": why, "message": redact(output[-3000:])}


def _download(job: dict[str, Any]) -> tuple[Path, int]:
    """The snapshot folder and the bytes written into the cache (never into a read_only one)."""
    if job.get("local_dir"):
        return Path(job["local_dir"]), 0
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import DryRunError

    # pinned to the user's cached commit: exactly the files its snapshot holds
    kwargs = {"revision": job["revision"], "cache_dir": job["cache_dir"], "allow_patterns": [
        glob.escape(f) for f in job.get("only") or ()] or ALLOW_PATTERNS}
    if job.get("read_only"):  # a dry run asks the hub what a job asks (a real one writes trees/)
        if not constants.is_offline_mode():
            with contextlib.suppress(DryRunError):  # unreachable: a job reads its cache
                snapshot_download(job["model"], dry_run=True, **kwargs)
        return Path(snapshot_download(job["model"], local_files_only=True, **kwargs)), 0

    def cached() -> int:
        return sum(p.stat().st_size for p in blob_files(job["cache_dir"], job["model"]))

    before = cached()
    return Path(snapshot_download(job["model"], **kwargs)), cached() - before


def _load_kwargs(job: dict[str, Any], device: str) -> dict[str, Any]:
    import torch
    from transformers import BitsAndBytesConfig

    bf16 = device == "cpu" or torch.cuda.is_bf16_supported()
    return {"device_map": {"": device}, "trust_remote_code": bool(job["trust_remote_code"]),
            **({"quantization_config": BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float16)}
               if job["quantize"] else {"dtype": "auto"})}


def _load(job: dict[str, Any]) -> dict[str, Any]:
    """Each part's seconds back to back (LOAD_PARTS less import), `load_s` one clock around all."""
    import safetensors.torch
    from transformers import AutoConfig, AutoTokenizer

    from diag.machine.device import resolve, sync

    perf, trust = time.perf_counter, bool(job["trust_remote_code"])
    device = str(resolve(job["device"]))
    quantized = {"seconds": 0.0, "bytes": 0}
    if job["quantize"]:
        import bitsandbytes.functional as bnb_functional

        real_quantize = bnb_functional.quantize_4bit

        def timed_quantize(A: Any, *args: Any, **kwargs: Any) -> Any:
            sync(device)  # note: CPU-GPU sync point: the copy queued before is not billed here
            start = perf()
            out = real_quantize(A, *args, **kwargs)
            sync(device)  # note: CPU-GPU sync point: the quantize kernel is billed here
            quantized["seconds"] += perf() - start
            quantized["bytes"] += A.numel() * A.element_size()
            return out

        # Params4bit._quantize looks it up on the module at each call
        bnb_functional.quantize_4bit = timed_quantize
    kwargs = _load_kwargs(job, device)
    start = t0 = perf()  # start: the end-to-end clock, apart from the parts
    folder, downloaded = _download(job)
    weights = weight_files(folder)  # raises if there are only pickle weights: never loaded
    t1 = perf()
    # load_file maps lazily: clone() bills a cold disk read here, not to the first op
    state = {k: v.clone() for path in weights
             for k, v in safetensors.torch.load_file(path, device="cpu").items()}
    t2 = perf()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust)
    model, info = _model_class(config, folder, trust).from_pretrained(
        None, config=config, state_dict=state, output_loading_info=True, **kwargs)
    sync(device)  # note: CPU-GPU sync point: queued copies are billed to to_device
    t3 = perf()
    AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    t4 = perf()
    token_bytes = sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("tokenizer"))
    return {"device": device, "load_s": t4 - start, "quantized": bool(job["quantize"]),
            "warning": _warning(config, model, info),
            "parts": {"download": {"seconds": t1 - t0, "bytes": downloaded},
                      "read": {"seconds": t2 - t1, "bytes": sum(p.stat().st_size for p in weights)},
                      "quantize": quantized,
                      "to_device": {"seconds": (t3 - t2) - quantized["seconds"],
                                    "bytes": int(model.get_memory_footprint())},
                      "tokenizer": {"seconds": t4 - t3, "bytes": token_bytes}}}


def _warning(config: Any, model: Any, info: dict[str, Any]) -> str:
    """'' when the checkpoint is the causal LM that was loaded with every weight used; else why."""
    archs, loaded = list(getattr(config, "architectures", None) or []), type(model).__name__
    notes = [f"the checkpoint is {'/'.join(archs)} (model_type "
             f"{getattr(config, 'model_type', '')!r}, from its config.json), not a causal LM; "
             f"AutoModelForCausalLM loaded it as {loaded}"] if archs and loaded not in archs else []
    for key, what in (("missing_keys", "not in the checkpoint, initialised at random"),
                      ("unexpected_keys", "in the checkpoint, not used (dropped)"),
                      ("mismatched_keys", "of the wrong shape, initialised at random")):
        names = sorted(str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get(key) or [])
        if names:
            notes.append(f"{len(names)} weights {what}: " + ", ".join(names[:4])
                         + (", ..." if len(names) > 4 else ""))
    return "; ".join(notes)


def _plain(job: dict[str, Any]) -> dict[str, Any]:
    """The one call users write: from_pretrained(repo or folder, ...)."""
    from transformers import AutoModelForCausalLM

    from diag.machine.device import resolve, sync

    device, local = str(resolve(job["device"])), job.get("local_dir")
    kwargs = {**_load_kwargs(job, device), **({} if local else {
        "revision": job["revision"], "cache_dir": job["cache_dir"]})}
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(local or job["model"], use_safetensors=True, **kwargs)
    sync(device)  # note: CPU-GPU sync point: queued copies are billed to the call
    return {"device": device, "seconds": time.perf_counter() - start}


def _raw_read(job: dict[str, Any]) -> dict[str, Any]:
    """safetensors' own read into host memory: the bench's yardstick for the read part."""
    import safetensors.torch

    start = time.perf_counter()
    for path in job["files"]:
        {k: v.clone() for k, v in safetensors.torch.load_file(path, device="cpu").items()}
    return {"seconds": time.perf_counter() - start}


def _model_class(config: Any, folder: Path, trust: bool) -> Any:
    """The class AutoModelForCausalLM picks for this config (its mapping, or the repo's code)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    ref = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if not (trust and ref):
        raise ValueError(f"{type(config).__name__} has no causal-LM class in transformers; "
                         "a model with its own code needs trust_remote_code=True")
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module(ref, str(folder))


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One job in this process (its libraries already imported); failures come back as data."""
    try:
        if job["mode"] == "download":
            t0 = time.perf_counter()
            downloaded = _download(job)[1]
            return {"parts": {"download": {"seconds": time.perf_counter() - t0,
                                           "bytes": downloaded}}}
        return {"plain": _plain, "raw_read": _raw_read}.get(job["mode"], _load)(job)
    except (OSError, ValueError, RuntimeError, KeyError, ImportError) as err:
        from huggingface_hub import constants, errors

        offline = "offline_not_cached" if constants.HF_HUB_OFFLINE else "unreachable_not_cached"
        kinds = ((errors.RevisionNotFoundError, "revision_not_found"),  # before its base class
                 (errors.RepositoryNotFoundError, "repo_not_found"),
                 (errors.LocalEntryNotFoundError, offline))
        kind = next((name for cls, name in kinds if isinstance(err, cls)),
                    "remote_code" if "trust_remote_code" in str(err) else "other")
        return {"error": kind, "type": type(err).__name__, "message": redact(str(err))[-2000:]}


def _imported_then_run(job: dict[str, Any], spawned_at: float) -> dict[str, Any]:
    """The job's imports (a bare download: huggingface_hub's only), then the job; `import_s`."""
    if job["mode"] != "download":
        import_libraries()  # forked: bitsandbytes where the zygote left it out; else free
    import_s = time.perf_counter() - spawned_at
    return {**run_job(job), "import_s": import_s}


def _child(request: dict[str, Any], import_s: float, out: Any, log: int) -> None:
    """A forked child: the job's result to `out`, its output (a traceback) to `log`."""
    die_with_parent()  # a zygote killed mid-load leaves no orphan
    for fd in (1, 2):
        os.dup2(log, fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # no prompt reads the protocol pipe
    started = time.perf_counter()
    # the environment a fresh interpreter would have had (docs/calibration.md)
    from huggingface_hub import constants

    os.environ.update(request["env"])
    constants.HF_HUB_OFFLINE = constants._is_true(
        os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))
    constants.HF_XET_CACHE = os.environ.get("HF_XET_CACHE", constants.HF_XET_CACHE)
    out.send(_imported_then_run(request["job"], started - import_s))


def _fork_one(request: dict[str, Any], import_s: float) -> dict[str, Any]:
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    result, out = fork.Pipe(duplex=False)
    with tempfile.TemporaryFile() as log:
        child = fork.Process(target=_child, args=(request, import_s, out, log.fileno()))
        child.start()
        out.close()
        try:
            if not result.poll(request["timeout_s"]):
                child.kill()
                return {"error": "timeout", "type": "timeout", "message": ""}
            return result.recv()
        except EOFError:  # it ended with no result
            child.join()
            log.seek(0)
            return crashed(f"exit code {child.exitcode}", log.read().decode(errors="replace"))
        finally:
            child.join()
            result.close()


def zygote(protocol: IO[str], spawned_at: float) -> int:
    """Import once, check that forking is safe, then fork a child per request line on stdin."""
    try:
        import numpy  # noqa: F401  its OpenBLAS pool: the one thread allowed
        threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
        baseline = threads()
        import_libraries(with_cuda_libraries=False)
        import_s = time.perf_counter() - spawned_at
        import torch

        # safe to fork: no CUDA, no torch op yet (no OpenMP pool), no HTTP client; OpenBLAS's
        # threads stop and restart around fork (pthread_atfork). Anything more is refused
        if torch.cuda.is_initialized() or threads() != baseline:
            raise RuntimeError(f"unsafe to fork: CUDA initialised={torch.cuda.is_initialized()}, "
                               f"threads {threads()} (numpy alone: {baseline})")
    except (ImportError, RuntimeError) as err:
        print(json.dumps({"error": "zygote", "type": type(err).__name__, "message": str(err)}),
              file=protocol, flush=True)
        return 1
    print(json.dumps({"import_s": import_s}), file=protocol, flush=True)
    for line in sys.stdin:
        print(json.dumps(_fork_one(json.loads(line), import_s)), file=protocol, flush=True)
    return 0


def main(job: dict[str, Any]) -> int:
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a library's print goes to the log, never into the protocol
    spawned_at = job.get("spawned_at", time.perf_counter())  # CLOCK_MONOTONIC: machine-wide
    if job["mode"] == "zygote":
        return zygote(protocol, spawned_at)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # no trust prompt waits on stdin
    print(json.dumps(_imported_then_run(job, spawned_at)), file=protocol, flush=True)
    return 0


if __name__ == "__main__":
    code = main(json.loads(sys.argv[1]))
    sys.stderr.flush()
    # every reply flushed, no child left: skip the teardown close() would wait for
    os._exit(code)
