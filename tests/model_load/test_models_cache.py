"""The user's own HF cache is read, never written: byte for byte, path for path (refs, snapshots,
blobs, trees, .no_exist, .locks) after every scenario, and after the hub's `main` moved past the
cached commit, which is said in one line; a cache holding part of the repo (what from_pretrained
or snapshot_download(allow_patterns) leaves) is sound. Against the embedded hub on loopback, in
a hub root of this test's own (so a ref can move; its repo has a LICENSE and a README beside
the model, as the hub's do), with real load processes."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest

from diag.config import ModelLoadConfig
from diag.embedded import HubServer, ensure_assets
from diag.embedded.hub import publish_model
from diag.model_load import run_model_load, source, verify_model_cache
from diag.model_load.source import cache_dir_for, user_hub_cache

REPO = "diag-test/tiny-llama"
ALL = ["fresh", "cached", "cached_offline", "cached_cold"]


def tree(root: Path) -> dict[str, object]:
    """Every path under root: a file's bytes, a link's target, a folder's mark."""
    out: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = path.read_bytes()
    return out


@pytest.fixture
def hub(tmp_path):
    model = tmp_path / "repo"
    shutil.copytree(ensure_assets().model_dir, model)
    (model / "LICENSE.txt").write_text("a license no load fetches\n")
    (model / "README.md").write_text("# a model card\n")
    root = tmp_path / "hub"
    publish_model(model, root, REPO)
    with HubServer(root) as server:
        yield server, root, model


def like_from_pretrained(server, cache: Path) -> None:
    """The cache `from_pretrained(REPO)` leaves: the files a load asks for, one hf_hub_download
    each (no trees/ listing), never the LICENSE or the README."""
    from huggingface_hub import hf_hub_download

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        hf_hub_download(REPO, name, cache_dir=cache, endpoint=server.endpoint)


def part_of_the_repo(server, cache: Path) -> None:
    """`hf download REPO --include '*.json' '*.safetensors'`: a snapshot of part of the repo,
    with the tree listing huggingface_hub keeps beside it."""
    from huggingface_hub import snapshot_download

    snapshot_download(REPO, cache_dir=cache, endpoint=server.endpoint,
                      allow_patterns=["*.json", "*.safetensors"])


def test_the_cache_is_where_huggingface_hub_looks(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert user_hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))  # alone: it counts
    assert user_hub_cache() == tmp_path / "legacy"
    assert cache_dir_for(ModelLoadConfig.quick(model=REPO)) == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert user_hub_cache() == tmp_path / "new"


@pytest.mark.slow
def test_the_users_cache_is_byte_identical_after_every_scenario_and_a_moved_ref(
        hub, tmp_path, monkeypatch):
    server, root, model_dir = hub
    user = tmp_path / "user-cache"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(user))  # the legacy variable, alone
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    like_from_pretrained(server, user)  # the user's own load, before diag
    cached_commit = (user / f"models--{REPO.replace('/', '--')}" / "refs" / "main").read_text()
    before = tree(user)
    assert not any(p.startswith(f"models--{REPO.replace('/', '--')}/trees") for p in before)
    cfg = ModelLoadConfig.quick(model=REPO, scenarios=ALL, warmup=1)  # no --cache-dir: theirs
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to say: the ref is where it was
        frame = run_model_load(cfg).frame
    assert set(frame["scenario"]) == set(ALL) and "from_pretrained" in set(frame["part"])
    assert tree(user) == before

    # the hub's main moves: a new commit with one more file a load would fetch (*.txt)
    moved = tmp_path / "moved-model"
    shutil.copytree(model_dir, moved)  # with the LICENSE and README the cache never held
    (moved / "notes.txt").write_text("a file the cached commit does not have\n")
    new_commit = publish_model(moved, root, REPO)
    assert new_commit != cached_commit
    with pytest.warns(RuntimeWarning, match=rf"{REPO}@main moved: your HF cache holds commit "
                                            rf"{cached_commit[:12]}, the hub's is "
                                            rf"{new_commit[:12]}; diag loaded the cached commit"):
        frame = run_model_load(cfg.replace(scenarios=["cached", "cached_offline"])).frame
    assert tree(user) == before  # not downloaded, no ref moved, no .no_exist marker
    snapshot = source.snapshot_folder(user, REPO)
    assert snapshot is not None and snapshot.name == cached_commit
    warned = set(frame.loc[frame["part"] == "load_model", "warning"])
    assert len(warned) == 1 and "moved" in warned.pop()

    # with --repair-cache the user lets diag write: the cache then follows the hub
    run_model_load(cfg.replace(scenarios=["cached"], repair_cache=True))
    assert source.snapshot_folder(user, REPO).name == new_commit


def test_the_jobs_persistent_cache_is_the_one_model_load_reads(hub, tmp_path, monkeypatch):
    import dataclasses

    from diag.config import QLoraConfig
    from diag.qlora import Plan
    from diag.qlora.base import model_folder
    from diag.qlora.job import open_sources

    server, _, _ = hub
    user = tmp_path / "user-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(user))
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    cfg = QLoraConfig.quick(model=REPO, source="s3://diag/data.jsonl")  # no --cache-dir: theirs
    with pytest.raises(RuntimeError, match=rf"^{REPO}@main is not in your HF cache at {user} ") \
            as err:
        with open_sources(cfg):
            pass
    assert "\n" not in str(err.value) and not user.exists()  # refused before anything, one line
    with open_sources(cfg.replace(plan="naive")):  # the naive plan never reads it
        pass
    part_of_the_repo(server, user)  # the user's `hf download --include`, before diag
    before = tree(user)
    persistent = dataclasses.replace(Plan.naive(), model_cache="persistent")
    with open_sources(cfg) as src:
        assert src.cache_dir == cache_dir_for(cfg) == user and src.read_only
        folder = model_folder(persistent, src, tmp_path / "work")
    assert folder == source.snapshot_folder(user, REPO) and tree(user) == before


def test_a_snapshot_of_part_of_the_repo_is_sound_and_left_as_it_is(hub, tmp_path, monkeypatch):
    server, _, _ = hub
    user = tmp_path / "user-cache"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(user))
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    part_of_the_repo(server, user)
    before = tree(user)
    frame = verify_model_cache(ModelLoadConfig.quick(model=REPO))  # the hub's checksums too
    assert set(frame["status"]) == {"ok"}, frame.to_string()  # no LICENSE.txt, no README: sound
    assert "model.safetensors" in set(frame["file"]) and tree(user) == before


def test_a_cached_models_fresh_load_is_estimated_from_one_files_download(hub, tmp_path):
    """diag run does not download a cached model whole (issue 32): one weight file through the
    hub protocol gives the rate, the model's cached bytes at it replace the cached load's
    revision check, and every row says it is an estimate."""
    from huggingface_hub import snapshot_download

    from diag.model_load.experiment import _fresh_estimate
    from diag.model_load.source import Source

    server, _, _ = hub
    cache = tmp_path / "cache"
    snapshot_download(REPO, cache_dir=cache, endpoint=server.endpoint)
    cached = [{"scenario": "cached", "repeat": 0, "part": part, "bytes": 0, "seconds": seconds,
               "cache_state": "warm"}
              for part, seconds in (("import", 9.0), ("download", 0.2), ("read", 0.1),
                                    ("load_model", 10.0), ("from_pretrained", 1.0))]
    got = {r["part"]: r for r in _fresh_estimate(
        Source(REPO, "main", server.endpoint, None, {}), cache, cached)}
    total = sum(p.stat().st_size for p in source.blob_files(cache, REPO))
    assert set(got) == {"import", "download", "read", "load_model"}  # from_pretrained is not
    assert got["download"]["bytes"] == total and got["download"]["seconds"] > 0
    assert got["load_model"]["seconds"] == pytest.approx(10.0 - 0.2 + got["download"]["seconds"])
    assert got["import"]["seconds"] == 9.0 and all(r["scenario"] == "fresh" for r in got.values())
    assert all(r["cache_state"].startswith("estimated: model.safetensors") for r in got.values())
    assert list(tmp_path.glob(".diag-rate-*")) == []  # the one file's cache is removed
