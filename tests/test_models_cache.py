"""The user's own HF cache is read, never written: byte for byte, path for path (refs, snapshots,
blobs, .no_exist, .locks) after every scenario, and after the hub's `main` moved past the cached
commit, which is said in one line. Against the embedded hub on loopback, in a hub root of this
test's own (so a ref can move), with real load processes."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest

from diag.config import ModelLoadConfig
from diag.embedded import HubServer, ensure_assets
from diag.embedded.hub import publish_model
from diag.model_load import hfcache, run_model_load
from diag.model_load.source import cache_dir_for, user_hub_cache
from diag.model_load.worker import run_worker

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
    assets = ensure_assets()
    root = tmp_path / "hub"
    publish_model(assets.model_dir, root, REPO)
    with HubServer(root) as server:
        yield server, root, assets.model_dir


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
    got = run_worker({"mode": "download", "model": REPO, "revision": "main",
                      "cache_dir": str(user), "local_dir": ""}, {**os.environ})
    assert "error" not in got  # the user's `hf download`, before diag
    cached_commit = (user / f"models--{REPO.replace('/', '--')}" / "refs" / "main").read_text()
    before = tree(user)
    cfg = ModelLoadConfig.quick(model=REPO, scenarios=ALL, warmup=1)  # no --cache-dir: theirs
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing to say: the ref is where it was
        frame = run_model_load(cfg).frame
    assert set(frame["scenario"]) == set(ALL) and "from_pretrained" in set(frame["part"])
    assert tree(user) == before

    # the hub's main moves: a new commit with one more file a load would fetch (*.txt)
    moved = tmp_path / "moved-model"
    shutil.copytree(model_dir, moved)
    (moved / "notes.txt").write_text("a file the cached commit does not have\n")
    new_commit = publish_model(moved, root, REPO)
    assert new_commit != cached_commit
    with pytest.warns(RuntimeWarning, match=rf"{REPO}@main moved: your HF cache holds commit "
                                            rf"{cached_commit[:12]}, the hub's is "
                                            rf"{new_commit[:12]}; diag loaded the cached commit"):
        frame = run_model_load(cfg.replace(scenarios=["cached", "cached_offline"])).frame
    assert tree(user) == before  # not downloaded, no ref moved, no .no_exist marker
    snapshot = hfcache.snapshot_folder(user, REPO)
    assert snapshot is not None and snapshot.name == cached_commit
    warned = set(frame.loc[frame["part"] == "load_model", "warning"])
    assert len(warned) == 1 and "moved" in warned.pop()

    # with --repair-cache the user lets diag write: the cache then follows the hub
    run_model_load(cfg.replace(scenarios=["cached"], repair_cache=True))
    assert hfcache.snapshot_folder(user, REPO).name == new_commit


def test_the_jobs_persistent_cache_is_the_one_model_load_reads(hub, tmp_path, monkeypatch):
    import dataclasses

    from diag.config import QLoraConfig
    from diag.qlora import Plan
    from diag.qlora.job import model_folder, open_sources

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
    got = run_worker({"mode": "download", "model": REPO, "revision": "main",
                      "cache_dir": str(user), "local_dir": ""}, {**os.environ})
    assert "error" not in got  # the user's `hf download`, before diag
    before = tree(user)
    persistent = dataclasses.replace(Plan.naive(), model_cache="persistent")
    with open_sources(cfg) as src:
        assert src.cache_dir == cache_dir_for(cfg) == user and src.read_only
        folder = model_folder(persistent, src, tmp_path / "work")
    assert folder == hfcache.snapshot_folder(user, REPO) and tree(user) == before
