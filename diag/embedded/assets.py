"""The embedded assets, made once under DIAG_HOME (by one process) and reused, each appearing whole.

`ensure_assets()`: the synthetic dataset and the tiny Llama, published into the hub root
`HubServer` serves; `embedded_dataset(size_mb, shards)`: any size, for the storage experiment."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from diag.config import diag_home
from diag.embedded.hub import publish_model
from diag.files import atomic_file, atomic_folder, sweep_orphans
from diag.timing.distributed import timeout_s

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4},  # ~1.6 MB, about a second
    "small": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16},  # ~420 MB fp32, ~5 s
}
DATASET_MB = 4  # the embedded dataset: big enough to time, small enough to make in a second


@dataclass(frozen=True)
class Assets:
    dataset: Path  # JSONL of synthetic records
    model_dir: Path  # the model folder as saved (safetensors + tokenizer)
    hub_root: Path  # what HubServer serves
    repo_id: str  # the model's id on that hub


def ensure_assets(home: str | os.PathLike[str] | None = None, *, model: str = "tiny") -> Assets:
    """Make (once) the embedded dataset and model, published into a local hub root."""
    if model not in MODEL_SIZES:
        raise ValueError(f"model={model!r}: allowed values are {', '.join(map(repr, MODEL_SIZES))}")
    base = (Path(home) if home is not None else diag_home()) / "assets"
    assets = Assets(dataset=base / f"dataset-{DATASET_MB}mb-seed0.jsonl",
                    model_dir=base / "models" / model, hub_root=base / "hub",
                    repo_id=f"diag-local/{model}-llama")
    marker = base / f"{model}.complete.json"  # written last: a complete set

    def complete() -> bool:
        return (marker.is_file() and assets.dataset.is_file()
                and (assets.model_dir / "model.safetensors").is_file())

    if complete():
        return assets
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank():
        # transformers 5 writes a model's weights on global rank 0 only once a process group is
        # up: another rank (another node's) makes them in a process without one
        code = "import sys; from diag.embedded import ensure_assets; " \
               "ensure_assets(sys.argv[1], model=sys.argv[2])"
        run = subprocess.run([sys.executable, "-c", code, str(base.parent), model],
                             capture_output=True, text=True, check=False)
        if run.returncode or not complete():
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"making the embedded assets in {base} failed: {last}")
        return assets
    with _filling(base):  # the first process of this DIAG_HOME makes them; the others wait
        if not complete():
            _make(assets, marker, model)
    return assets


def _make(assets: Assets, marker: Path, model: str) -> None:
    from diag.embedded.synth import synthetic_dataset, tiny_model

    for folder in (marker.parent, marker.parent / "models"):  # what a killed make left
        sweep_orphans(folder)
    if not assets.dataset.is_file():
        synthetic_dataset(assets.dataset, target_mb=DATASET_MB, seed=0)
    tiny_model(assets.model_dir, dataset=assets.dataset, **MODEL_SIZES[model])
    commit = publish_model(assets.model_dir, assets.hub_root, assets.repo_id)
    with atomic_file(marker) as tmp:
        tmp.write_text(json.dumps({"commit": commit,
                                   **{k: str(v) for k, v in vars(assets).items()}}))


@contextlib.contextmanager
def _filling(base: Path) -> Iterator[None]:
    """Hold base/.fill.lock (flock: released by the kernel if the holder dies)."""
    import fcntl

    base.mkdir(parents=True, exist_ok=True)
    timeout = timeout_s("fill")  # a first make's wait, apart from the collectives' bound
    deadline = time.monotonic() + timeout
    with open(base / ".fill.lock", "w") as lock:
        while True:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"waited {timeout:g} s for another process to make the "
                                   f"embedded assets in {base}; raise DIAG_FILL_TIMEOUT_S "
                                   "if a first make takes longer here")
            time.sleep(0.2)
        yield


def embedded_dataset(size_mb: float, shards: int = 1) -> Path:
    """A synthetic JSONL dataset of size_mb (one file, or a folder of `shards` files), made once."""
    from diag.embedded.synth import synthetic_dataset

    base = diag_home() / "storage"
    name = f"synthetic-{size_mb:g}mb"
    path = base / (f"{name}.jsonl" if shards == 1 else f"{name}-{shards}shards")
    if path.exists():
        return path
    sweep_orphans(base)  # what a killed make left half-written
    if shards == 1:
        return synthetic_dataset(path, target_mb=size_mb, seed=0)
    with atomic_folder(path, replace=False) as tmp:  # seeded: a concurrent make's is the same
        for i in range(shards):
            synthetic_dataset(tmp / f"shard-{i:05d}.jsonl", target_mb=size_mb / shards, seed=i)
    return path
