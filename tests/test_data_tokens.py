"""diag.data.tokens: one token cache for the loader sweep, the accum sweep and the QLoRA job, and
a build killed before its meta is rebuilt, never taken."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diag.config import LoaderConfig, QLoraConfig
from diag.data import PackedDataset, build_token_cache, ensure_tokens
from diag.embedded import ensure_assets, synthetic_dataset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok_dir() -> str:
    return str(ensure_assets().model_dir)


def test_loader_accum_and_qlora_share_one_cache_built_once(tok_dir, tmp_path, monkeypatch):
    from diag.loader.sweep import make_dataset
    from diag.qlora.data import build_dataset, check_records, read
    from diag.qlora.plans import Plan

    monkeypatch.setenv("DIAG_HOME", str(tmp_path / "home"))
    data = synthetic_dataset(tmp_path / "d.jsonl", records=80)
    landed = tmp_path / "landed" / "d.jsonl"  # the QLoRA job reads its own copy of the data
    landed.parent.mkdir()
    shutil.copy(data, landed)

    _, loader = make_dataset("packed", LoaderConfig.quick(), str(data), tok_dir)
    assert loader["cache"] == "built"
    accum = ensure_tokens(tok_dir, data)
    cfg = QLoraConfig.quick()
    records, bad = read(cfg, landed)
    recs = check_records(cfg, records, Path(tok_dir), bad)
    plan = dataclasses.replace(Plan.naive(), pipeline="packed")
    job = build_dataset(cfg, plan, recs, Path(tok_dir), landed)
    assert job.stats["data"].startswith("token cache hit")

    folders = [p for p in (tmp_path / "home" / "tokens").iterdir()]
    assert folders == [Path(loader["cache_folder"])] == [accum.path.parent]
    assert accum.path.name == "train.bin" and accum.dtype == "uint16"
    # the job packs exactly its records' tokens from the shared arrays
    stream = np.memmap(accum.path, dtype=accum.dtype, mode="r")
    packed = job.dataset.packed
    assert packed.tokens == sum(recs.lengths)
    first = packed[0]["input_ids"][: min(cfg.seq_len, recs.lengths[0])].tolist()
    assert first == stream[: len(first)].tolist()
    again = build_token_cache(data, tok_dir)
    assert again.status == "hit" and again.folder == folders[0]


KILLED_BUILD = """
import os, signal, sys
import diag.data.tokens as tokens
def killed(tmp, meta):  # the process dies with every array written and no meta.json yet
    os.kill(os.getpid(), signal.SIGKILL)
tokens.write_meta = killed
tokens.build_token_cache(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3])
"""


@pytest.mark.slow
def test_a_build_killed_before_its_meta_is_rebuilt_not_taken(tok_dir, tmp_path):
    data = synthetic_dataset(tmp_path / "d.jsonl", records=30)
    cache_dir = tmp_path / "tokens"
    done = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(data), tok_dir,
                           str(cache_dir)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = list(cache_dir.iterdir())
    assert len(left) == 1 and ".tmp-" in left[0].name  # arrays, never swapped in
    assert (left[0] / "train.bin").is_file() and not (left[0] / "meta.json").exists()

    cache = build_token_cache(data, tok_dir, cache_dir=cache_dir)
    assert cache.status == "built" and cache.records == 30
    assert list(cache_dir.iterdir()) == [cache.folder]  # the dead build's folder is cleared

    # a finished folder torn afterwards (ids cut short) is not a cache either
    with open(cache.folder / "train.bin", "r+b") as f:
        f.truncate(10)
    torn = build_token_cache(data, tok_dir, cache_dir=cache_dir)
    assert torn.status == "rebuilt: the old cache was incomplete"
    assert torn.tokens == cache.tokens and torn.folder == cache.folder
    assert build_token_cache(data, tok_dir, cache_dir=cache_dir).status == "hit"


def test_packed_dataset_over_some_records_packs_only_those(tok_dir, tmp_path):
    data = synthetic_dataset(tmp_path / "d.jsonl", records=12)
    cache = build_token_cache(data, tok_dir, cache_dir=tmp_path / "c")
    offsets = np.load(cache.folder / "offsets.npy")
    whole = PackedDataset(cache.folder, seq_len=16)
    some = PackedDataset(cache.folder, seq_len=16, records=[3, 7])
    ids = [whole._span(int(offsets[i]), int(offsets[i + 1]))[0] for i in (3, 7)]
    assert some.tokens == sum(len(i) for i in ids)
    got = np.concatenate([some[w]["input_ids"].numpy() for w in range(len(some))])
    assert got[: some.tokens].tolist() == np.concatenate(ids).tolist()
    prefix = PackedDataset(cache.folder, seq_len=16, records=range(4))
    assert prefix.tokens == offsets[4] and prefix._positions is None
    with pytest.raises(IndexError, match="holds 12 records"):
        PackedDataset(cache.folder, seq_len=16, records=[12])
