"""The embedded defaults: real loopback servers, real clients (boto3, huggingface_hub,
transformers)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from diag.config import diag_home
from diag.embedded import Assets, HubServer, LoopbackServer, S3Server, ensure_assets, publish_model
from diag.embedded.synth import synthetic_dataset, synthetic_records, tiny_model

ROOT = Path(__file__).resolve().parents[2]
REPO = "diag-local/tiny-llama"


@pytest.fixture(scope="session")
def assets(_isolated_home: Path) -> Assets:
    # made once per session under the temporary DIAG_HOME set by conftest
    assert diag_home() == _isolated_home
    return ensure_assets()


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


# -- S3 ------------------------------------------------------------------------------------------

def test_s3_round_trip_and_clean_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with S3Server(bucket="diag") as s3:
        pid = s3.pid
        assert pid is not None and s3.url == f"http://127.0.0.1:{s3.port}" == s3.endpoint_url
        client = s3.client()
        payload = os.urandom(300_000)
        client.put_object(Bucket="diag", Key="raw/blob.bin", Body=payload)
        assert client.get_object(Bucket="diag", Key="raw/blob.bin")["Body"].read() == payload

        (tmp_path / "sub").mkdir()
        (tmp_path / "a.txt").write_text("a")
        (tmp_path / "sub" / "b.txt").write_text("bb")
        assert s3.upload(tmp_path, "up/") == ["up/a.txt", "up/sub/b.txt"]
        assert s3.upload(tmp_path / "a.txt", "single.txt") == ["single.txt"]

        # the standard credential chain: a bare boto3.client("s3") finds the server via env vars
        for key, value in s3.env().items():
            monkeypatch.setenv(key, value)
        import boto3

        listed = boto3.client("s3").list_objects_v2(Bucket="diag")["Contents"]
        assert sorted(o["Key"] for o in listed) == [
            "raw/blob.bin", "single.txt", "up/a.txt", "up/sub/b.txt"]
    assert s3.pid is None and _group_gone(pid)


def test_server_stops_when_body_raises(assets: Assets) -> None:
    with pytest.raises(KeyError):
        with HubServer(assets.hub_root) as hub:
            pid = hub.pid
            raise KeyError("boom")
    assert _group_gone(pid)


def test_port_in_use_is_a_clear_error(assets: Assets) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError,
                           match=f"port {port} on 127.0.0.1 is already in use.*port=None"):
            HubServer(assets.hub_root, port=port).start()
    with pytest.raises(ValueError, match="port="):
        S3Server(port=70000)


def test_start_failure_shows_the_servers_output() -> None:
    class Broken(LoopbackServer):
        def command(self, port: int) -> list[str]:
            return [sys.executable, "-c",
                    "import sys; sys.stderr.write('no such flag'); sys.exit(3)"]

    server = Broken()
    with pytest.raises(RuntimeError, match="exited during start-up(.|\n)*no such flag"):
        server.start()
    assert server.pid is None


# -- hub -----------------------------------------------------------------------------------------

def test_snapshot_download_is_byte_identical(assets: Assets, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    with HubServer(assets.hub_root) as hub:
        assert hub.env() == {"HF_ENDPOINT": hub.endpoint}
        # endpoint= because this process imported huggingface_hub before HF_ENDPOINT existed
        snap = Path(snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.endpoint))
        names = sorted(p.name for p in assets.model_dir.iterdir())
        assert sorted(p.name for p in snap.iterdir()) == names
        for name in names:
            assert (snap / name).read_bytes() == (assets.model_dir / name).read_bytes(), name
        # LFS-like: the weights' cache blob is named by the sha256 of its content
        weights = (snap / "model.safetensors").resolve()
        assert weights.name == hashlib.sha256(weights.read_bytes()).hexdigest()

        kw = {"cache_dir": tmp_path, "endpoint": hub.endpoint}
        with pytest.raises(EntryNotFoundError):
            hf_hub_download(REPO, "adapter_config.json", **kw)
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download("diag-local/missing", "config.json", **kw)
        with pytest.raises(RevisionNotFoundError):
            hf_hub_download(REPO, "config.json", revision="v9", **kw)

        # a resumed download asks for a byte range
        url = f"{hub.endpoint}/{REPO}/resolve/main/model.safetensors"
        req = urllib.request.Request(url, headers={"Range": "bytes=10-19"})
        with urllib.request.urlopen(req) as r:
            assert r.status == 206 and r.read() == weights.read_bytes()[10:20]
            assert r.headers["Content-Range"] == f"bytes 10-19/{weights.stat().st_size}"
        pid = hub.pid
    assert _group_gone(pid)


@pytest.mark.slow
def test_transformers_loads_through_hf_endpoint(assets: Assets, tmp_path: Path) -> None:
    # HF_ENDPOINT is read when huggingface_hub is imported, and from_pretrained has no endpoint
    # argument: a fresh process with the variable set is the path a user's training script takes
    script = textwrap.dedent(f"""
        import json
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained({REPO!r})
        model = AutoModelForCausalLM.from_pretrained({REPO!r})
        ids = tok("What is 2 + 3?", return_tensors="pt").input_ids
        print(json.dumps({{"shape": list(model(ids).logits.shape), "n": ids.shape[1],
                          "vocab": model.config.vocab_size}}))
    """)
    with HubServer(assets.hub_root) as hub:
        env = {**os.environ, **hub.env(), "HF_HOME": str(tmp_path), "HF_HUB_DISABLE_TELEMETRY": "1"}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shape"] == [1, result["n"], result["vocab"]]
    assert any((tmp_path / "hub").glob(
        "models--diag-local--tiny-llama/snapshots/*/model.safetensors"))


def test_hub_serves_a_plain_folder_and_publish_is_idempotent(assets: Assets,
                                                             tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    root = tmp_path / "hub"
    (root / "org" / "plain").mkdir(parents=True)
    (root / "org" / "plain" / "config.json").write_text('{"a": 1}')
    first = publish_model(assets.model_dir, root, "org/pub", revision="v1")
    assert publish_model(assets.model_dir, root, "org/pub", revision="main") == first
    assert len(first) == 40 and not list((root / "org" / "pub" / "commits").glob(".tmp-*"))
    with HubServer(root) as hub:
        snap = Path(snapshot_download("org/plain", cache_dir=tmp_path / "c", endpoint=hub.endpoint))
        assert (snap / "config.json").read_text() == '{"a": 1}'
        snap = Path(snapshot_download("org/pub", revision="v1", cache_dir=tmp_path / "c",
                                      endpoint=hub.endpoint))
        assert snap.name == first
    with pytest.raises(ValueError, match="repo_id"):
        publish_model(assets.model_dir, root, "no-org")


# -- synthetic data and model --------------------------------------------------------------------

def test_synthetic_dataset_deterministic_and_sized(tmp_path: Path) -> None:
    a = synthetic_dataset(tmp_path / "a.jsonl", records=500, seed=1)
    b = synthetic_dataset(tmp_path / "b.jsonl", records=500, seed=1)
    c = synthetic_dataset(tmp_path / "c.jsonl", records=500, seed=2)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    lines = a.read_text().splitlines()
    assert len(lines) == 500
    assert ({tuple(sorted(json.loads(line))) for line in lines}
            == {("input", "instruction", "output")})
    assert json.loads(lines[0]) == next(synthetic_records(1, seed=1))

    sized = synthetic_dataset(tmp_path / "s.jsonl", target_mb=0.5)
    longest = max(map(len, sized.read_bytes().splitlines(keepends=True)))
    assert 500_000 <= sized.stat().st_size < 500_000 + longest
    assert not list(tmp_path.glob(".*tmp*"))


def test_shipped_sample_is_reproducible(tmp_path: Path) -> None:
    # data/README.md says how sample.jsonl was made; this keeps that line true
    remade = synthetic_dataset(tmp_path / "sample.jsonl", target_mb=2, seed=0)
    assert remade.read_bytes() == (ROOT / "data" / "sample.jsonl").read_bytes()


def test_synthetic_answers_are_correct() -> None:
    for rec in synthetic_records(300, seed=3):
        if rec["instruction"].startswith("What is "):
            a, op, b = rec["instruction"][len("What is "):-1].split()
            assert int(rec["output"]) == eval(f"{int(a)} {op} {int(b)}")  # noqa: S307 (digits only)
        elif rec["instruction"] == "Sort these words alphabetically.":
            assert rec["output"].split() == sorted(rec["input"].split())


@pytest.mark.parametrize("kwargs, name", [
    ({"records": 0}, "records"), ({"records": -3}, "records"), ({"target_mb": 0}, "target_mb"),
    ({"target_mb": -1.5}, "target_mb"), ({}, "records"),
    ({"records": 5, "target_mb": 1}, "target_mb"),
])
def test_synthetic_dataset_bad_sizes(tmp_path: Path, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        synthetic_dataset(tmp_path / "x.jsonl", **kwargs)
    assert not (tmp_path / "x.jsonl").exists()


def test_tiny_model_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        tiny_model(tmp_path / "m", hidden_size=100)
    with pytest.raises(ValueError, match="num_heads"):
        tiny_model(tmp_path / "m", num_heads=3)
    assert not (tmp_path / "m").exists()


def test_tiny_model_loads_in_4bit_on_cpu(assets: Assets) -> None:
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    size_mb = sum(p.stat().st_size for p in assets.model_dir.iterdir()) / 1e6
    assert size_mb < 5
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(assets.model_dir, quantization_config=quant,
                                                 device_map="cpu")
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert n4 == 7 * model.config.num_hidden_layers  # q k v o gate up down per layer
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    assert ((tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token)
            == ("<s>", "</s>", "<pad>", "<unk>"))
    batch = tok(["Sort these numbers: 3, 1, 2", "hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch.input_ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_ensure_assets_reuses_what_exists(assets: Assets) -> None:
    made = [p for root in (assets.model_dir, assets.hub_root) for p in root.rglob("*")]
    stamps = {p: p.stat().st_mtime_ns for p in [assets.dataset, *made]}
    again = ensure_assets()  # nothing made again: every file as it was (not a timing: at load)
    assert again == assets and {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert {p for root in (assets.model_dir, assets.hub_root) for p in root.rglob("*")} == set(made)
    assert assets.repo_id == REPO and assets.dataset.stat().st_size > 1_000_000
    assert str(assets.dataset).startswith(str(diag_home()))


def test_import_is_light() -> None:
    code = ("import sys, diag.embedded; "
            "print(sorted({'torch','boto3','transformers','tokenizers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = ("from diag.embedded import S3Server\nimport time\n"
              "s = S3Server().start()\nprint(s.pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(server_pid)
        parent.send_signal(signal.SIGKILL)  # no `with` exit, no finally: only the kernel can help
        parent.wait(timeout=10)
        deadline = time.perf_counter() + 10
        while psutil.pid_exists(server_pid) and time.perf_counter() < deadline:
            if psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.1)
        assert not psutil.pid_exists(server_pid) or (
            psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE)
    finally:
        parent.kill()
