"""Model-load faults, for real: bad ids, no network, a flipped byte, a SIGKILLed download, code.

Each test uses its own temporary HF cache and the embedded hub (or a throttling TCP proxy in
front of it); nothing is mocked. Errors must name what failed and where, and say what to do.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diag.model_load import source
from diag.config import ModelLoadConfig
from diag.model_load.processes import LoadProcesses
from diag.model_load import run_model_load, verify_model_cache

REPO = "diag-local/tiny-llama"
FAKE_TOKEN = "hf_diagFAKEtoken0123456789abcdef"


@pytest.fixture(scope="module")
def hub():
    from diag.embedded import HubServer, ensure_assets

    with HubServer(ensure_assets().hub_root) as server:
        yield server


@pytest.fixture
def at_hub(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub


def cfg(cache: Path, **kw) -> ModelLoadConfig:
    return ModelLoadConfig.quick(**{"model": REPO, "scenarios": ["cached"],
                                    "cache_dir": str(cache), **kw})


def download(cache: Path, endpoint: str) -> dict:
    job = {"mode": "download", "model": REPO, "revision": "main", "cache_dir": str(cache),
           "local_dir": ""}
    return LoadProcesses({**os.environ, "HF_ENDPOINT": endpoint}, "exec").run(job)


def test_unknown_model_or_revision_names_it_and_the_endpoint(at_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    with pytest.raises(RuntimeError) as err:
        run_model_load(cfg(tmp_path, model="diag-local/no-such-model"))
    assert f"model 'diag-local/no-such-model' not found at {at_hub.endpoint}" in str(err.value)
    assert FAKE_TOKEN not in str(err.value)
    with pytest.raises(RuntimeError, match=rf"revision 'v9' of model '{REPO}' not found at "
                                           rf"{at_hub.endpoint}"):
        run_model_load(cfg(tmp_path, revision="v9"))


def test_offline_with_nothing_cached_says_how_to_warm_it(at_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"'fresh', which downloads .* HF_HUB_OFFLINE=1 is set"):
        run_model_load(cfg(tmp_path, scenarios=["fresh", "cached"]))
    with pytest.raises(RuntimeError) as err:
        run_model_load(cfg(tmp_path))
    text = str(err.value)
    assert "HF_HUB_OFFLINE=1 is set" in text and f"not in the HF cache at {tmp_path}" in text
    assert "warm the cache once with network access" in text and "--scenarios cached" in text


def test_endpoint_down_with_nothing_cached(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(RuntimeError, match=rf"the hub at {dead} cannot be reached and {REPO}@main "
                                           rf"is not in the HF cache .* warm the cache"):
        run_model_load(cfg(tmp_path))


def test_flipped_byte_is_caught_never_loaded_and_repaired(at_hub, tmp_path):
    assert "error" not in download(tmp_path, at_hub.endpoint)
    assert (source.verify_cache(REPO, tmp_path)["status"] == "ok").all()
    weights = source.snapshot_folder(tmp_path, REPO) / "model.safetensors"
    blob, good = weights.resolve(), weights.read_bytes()
    assert len(blob.name) == 64  # an LFS blob: named by its sha256
    with open(blob, "r+b") as f:  # flip one byte in the middle of the tensors
        f.seek(len(good) // 2)
        f.write(bytes([good[len(good) // 2] ^ 0xFF]))
    report = source.verify_cache(REPO, tmp_path).set_index("file")
    assert report.loc["model.safetensors", "status"] == "corrupt"
    assert (report.drop("model.safetensors")["status"] == "ok").all()
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("a load process started before the damaged copy was refused")

    with pytest.MonkeyPatch.context() as patch, pytest.raises(
            RuntimeError, match=r"(?s)damaged copy .*corrupt: model.safetensors .*sha256"
                                r".*nothing was loaded.*--repair-cache"):
        patch.setattr(LoadProcesses, "__init__", no_load)  # refused before any load process
        run_model_load(cfg(tmp_path))
    fixed = verify_model_cache(cfg(tmp_path), repair=True).set_index("file")
    assert (fixed["status"] == "ok").all()
    assert fixed.loc["model.safetensors", "detail"] == "re-downloaded (was corrupt)"
    assert weights.read_bytes() == good


class ThrottledProxy:
    """A TCP proxy to `upstream` that sends responses at `rate` bytes/s (a slow link)."""

    def __init__(self, upstream: tuple[str, int], rate: float) -> None:
        self.upstream, self.rate = upstream, rate
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.rate),
                             daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, rate: float | None) -> None:
        try:
            while data := src.recv(8192):
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.slow
def test_download_killed_halfway_leaves_nothing_that_looks_complete(at_hub, tmp_path):
    proxy = ThrottledProxy((at_hub.host, at_hub.port), rate=400_000)
    job = {"mode": "download", "model": REPO, "revision": "main", "cache_dir": str(tmp_path),
           "local_dir": ""}
    env = {**os.environ, "HF_ENDPOINT": proxy.url, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "diag.model_load.worker", json.dumps(job)],
                            env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    weights_sha = json.loads(next((at_hub.root / REPO / "commits").glob(
        "*/.diag-manifest.json")).read_text())["files"]["model.safetensors"]["sha256"]
    blobs = source.repo_folder(tmp_path, REPO) / "blobs"
    deadline, seen = time.perf_counter() + 60, None
    try:
        # huggingface_hub writes 10 MB chunks, so the partial file may still be empty: kill 1 s
        # into the weights' ~3.7 s transfer (1.48 MB at 400 kB/s), about a third of the way
        while time.perf_counter() < deadline:
            if seen is None and list(blobs.glob(f"{weights_sha}.*.incomplete")):
                seen = time.perf_counter()
            if seen is not None and time.perf_counter() - seen > 1.0:
                break
            assert proc.poll() is None, "the download finished before it could be interrupted"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proxy.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (blobs / weights_sha).exists()  # only a partial, under a name no load uses
    partial = list(blobs.glob(f"{weights_sha}.*.incomplete"))
    assert partial and partial[0].stat().st_size < 1_478_032
    snapshot = source.snapshot_folder(tmp_path, REPO)
    assert snapshot is None or not (snapshot / "model.safetensors").exists()
    report = source.verify_cache(REPO, tmp_path)
    assert "incomplete" in set(report["status"]) and "missing" in set(report["status"])
    assert source.problems(report)  # diag refuses to load it as it is
    fixed = verify_model_cache(cfg(tmp_path), repair=True)
    assert (fixed["status"] == "ok").all() and not list(blobs.glob("*.incomplete"))


@pytest.mark.slow
def test_remote_code_stays_off_unless_asked(tmp_path):
    from diag.embedded import ensure_assets

    folder, marker = tmp_path / "custom", tmp_path / "code-ran"
    shutil.copytree(ensure_assets().model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="diag-custom", auto_map={"AutoConfig": "evil.EvilConfig",
                                                      "AutoModelForCausalLM": "evil.EvilModel"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(RuntimeError, match=r"needs trust_remote_code=True, which runs Python "
                                           r"code from the model repo"):
        run_model_load(ModelLoadConfig.quick(model=str(folder), scenarios=["cached"]))
    assert not marker.exists()
    assert ModelLoadConfig().trust_remote_code is False


def test_pickle_weights_are_never_loaded(tmp_path):
    folder, marker = tmp_path / "pickled", tmp_path / "unpickled"
    folder.mkdir()

    class Payload:  # unpickling this would create the marker file
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Payload()}))
    with pytest.raises(ValueError, match=r"only pickle files: pytorch_model.bin.*safetensors "
                                         r"only"):
        run_model_load(ModelLoadConfig.quick(model=str(folder)))
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"no such folder, and not a hub id"):
        run_model_load(ModelLoadConfig.quick(model=str(tmp_path / "absent")))


def bert_folder(folder: Path) -> Path:
    """A BERT encoder checkpoint as sentence-transformers ships one (BertModel, with a pooler),
    random weights. Written with numpy: the names and shapes are transformers 5.24's BertModel
    state_dict for this config (checked), without paying torch's import in the test process."""
    import numpy as np
    from safetensors.numpy import save_file

    from diag.embedded import ensure_assets

    folder.mkdir()
    h, ff, vocab = 32, 64, 512
    shapes = {"embeddings.word_embeddings.weight": (vocab, h),
              "embeddings.position_embeddings.weight": (64, h),
              "embeddings.token_type_embeddings.weight": (2, h), "pooler.dense.weight": (h, h)}
    layer = "encoder.layer.0."
    for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                 "attention.output.dense"):
        shapes[layer + name + ".weight"] = (h, h)
    shapes.update({layer + "intermediate.dense.weight": (ff, h),
                   layer + "output.dense.weight": (h, ff)})
    for weight, shape in list(shapes.items()):
        if not weight.endswith("embeddings.weight"):
            shapes[weight.replace(".weight", ".bias")] = (shape[0],)
    for norm in ("embeddings.LayerNorm", layer + "attention.output.LayerNorm",
                 layer + "output.LayerNorm"):
        shapes.update({norm + ".weight": (h,), norm + ".bias": (h,)})
    rng = np.random.default_rng(0)
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertModel"], "vocab_size": vocab,
        "hidden_size": h, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": ff, "max_position_embeddings": 64, "type_vocab_size": 2}))
    for tok in ensure_assets().model_dir.glob("tokenizer*"):
        shutil.copy(tok, folder / tok.name)
    return folder


@pytest.mark.slow
def test_an_encoder_is_named_and_its_dropped_weights_are_a_warning(tmp_path):
    folder = bert_folder(tmp_path / "bert")
    with pytest.warns(RuntimeWarning, match=r"the checkpoint is BertModel .*not a causal LM; "
                                            r"AutoModelForCausalLM loaded it as BertLMHeadModel"):
        frame = run_model_load(ModelLoadConfig.quick(model=str(folder), scenarios=["cached"])).frame
    text = frame.loc[frame["part"] == "load_model", "warning"].item()
    assert "weights in the checkpoint, not used (dropped): pooler.dense.bias" in text
    assert "weights not in the checkpoint, initialised at random: cls.predictions" in text
    assert (frame.loc[frame["part"] != "load_model", "warning"].fillna("") == "").all()


@pytest.mark.slow
def test_zygote_children_get_their_own_offline_setting(at_hub, tmp_path):
    job = {"mode": "download", "model": REPO, "revision": "main", "cache_dir": str(tmp_path),
           "local_dir": ""}
    with LoadProcesses({**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}) as procs:
        # huggingface_hub read HF_HUB_OFFLINE at import, in the zygote, where it was unset
        assert procs.run(job, {"HF_HUB_OFFLINE": "1"})["error"] == "offline_not_cached"
        got = procs.run(job)  # the previous child's setting did not leak into this one
        assert "error" not in got and got["parts"]["download"]["bytes"] > 1_000_000
        assert "error" not in procs.run(job, {"HF_HUB_OFFLINE": "1"})  # now cached: offline ok
        assert procs.import_s > 0.5 and got["import_s"] >= procs.import_s


def test_a_read_only_user_cache_is_reported_and_left_alone(at_hub, tmp_path, monkeypatch):
    user = tmp_path / "user-hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(user))
    plain = ModelLoadConfig.quick(model=REPO, scenarios=["cached"])  # no --cache-dir: the user's
    with pytest.raises(RuntimeError, match=r"not in your HF cache at .*user-hub-cache "
                                           r"\(HF_HUB_CACHE\).*writes nothing to it"):
        run_model_load(plain)
    assert not user.exists()
    assert "error" not in download(user, at_hub.endpoint)
    blob = (source.snapshot_folder(user, REPO) / "model.safetensors").resolve()
    with open(blob, "r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 16)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in user.rglob("*") if p.is_file()}
    with pytest.raises(RuntimeError, match=r"(?s)your HF cache \(left as it is\) at .*damaged.*"
                                           r"corrupt: model.safetensors.*--repair-cache"):
        run_model_load(plain)
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in user.rglob("*") if p.is_file()}
    assert after == before  # not a byte, not a timestamp
    fixed = verify_model_cache(plain.replace(repair_cache=True), repair=True)
    assert (fixed["status"] == "ok").all() and "re-downloaded (was corrupt)" in set(fixed["detail"])
