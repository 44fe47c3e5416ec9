"""Data where it already is: a local file or folder, a hub dataset (hf://datasets/...), and
compressed JSONL in a bucket, each through the same listing, fetch, preflight and reader."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diag.config import QLoraConfig, StorageConfig
from diag.data import read_source
from diag.embedded import HubServer, S3Server, ensure_assets
from diag.embedded.hub import publish_model
from diag.embedded.synth import synthetic_records
from diag.preflight import preflight
from diag.storage import fetch, list_remote, parse_url, run_storage, source_client

ROOT = Path(__file__).resolve().parents[2]


def _chat(n: int, seed: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"{r['instruction']} {r['input']}"},
                          {"role": "assistant", "content": r["output"]}]}
            for r in synthetic_records(n, seed=seed)]


def _gz_shards(folder: Path, shards: int = 2, n: int = 150) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        lines = "".join(json.dumps(r) + "\n" for r in _chat(n, seed=i))
        (folder / f"part-{i}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    return folder


def test_a_local_folder_of_compressed_shards_is_read_where_it_is(tmp_path):
    folder = _gz_shards(tmp_path / "chat")
    (folder / "README.md").write_text("not data")
    cfg = QLoraConfig.quick(source=str(folder), messages_field="messages")
    assert source_client(cfg) is None
    path, fetched, total = fetch(str(folder), None, "land", tmp_path / "work")
    assert path == folder and fetched == 0  # nothing pulled, nothing copied
    assert total == sum(p.stat().st_size for p in folder.glob("*.gz"))  # data files only
    records, _ = read_source(path, {"messages": "messages"})
    assert records == [{"messages": r["messages"]} for r in _chat(150, 0) + _chat(150, 1)]
    storage = run_storage(StorageConfig.quick(source=str(folder)))
    assert set(storage.frame["method"]) == {"local_read"} and storage.tax.empty
    assert "nothing to pull" in storage.decisions[0].why


def test_a_hub_dataset_is_listed_fetched_once_and_checked_like_a_bucket(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    rows = list(synthetic_records(64, seed=3))
    pq.write_table(pa.Table.from_pylist(rows[:32]), repo / "data" / "train-0.parquet",
                   compression="zstd")
    pq.write_table(pa.Table.from_pylist(rows[32:]), repo / "data" / "train-1.parquet",
                   compression="gzip")
    (repo / "README.md").write_text("a dataset card")
    publish_model(repo, tmp_path / "hub" / "datasets", "org/qa")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "users-cache"))  # must stay empty
    with HubServer(tmp_path / "hub") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        source = "hf://datasets/org/qa/data/"
        cfg = QLoraConfig.quick(source=source, records=8, steps=2)
        assert [o.key for o in list_remote(source_client(cfg), parse_url(source))] == [
            "data/train-0.parquet", "data/train-1.parquet"]
        preflight(cfg, cfg)  # the first shard's first rows, read by ranges: no refusal
        path, fetched, total = fetch(source, source_client(cfg), "land", tmp_path / "w")
        assert fetched == total and read_source(path)[0] == rows
        again = fetch(source, source_client(cfg), "land", tmp_path / "w")[0]
        assert again == path and path.is_relative_to(os.environ["DIAG_HOME"])  # landed once
        pulled = run_storage(StorageConfig.quick(source=source, local_dir=str(tmp_path / "l")))
        pulls = pulled.frame[pulled.frame["method"] == "hf_hub"]
        assert len(pulls) == 2 and (pulls["bytes"] == total).all()  # timed like a bucket's
        assert pulled.tax["method"].tolist() == ["hf_hub"]
        assert list((tmp_path / "l").iterdir()) == []  # its scratch gone
        with pytest.raises(ValueError, match="--prompt-field='q': no such column"):
            preflight(QLoraConfig.quick(source=source, prompt_field="q", response_field="a"),
                      QLoraConfig.quick(source=source, prompt_field="q", response_field="a"))
        with pytest.raises(RuntimeError, match="hf://datasets/org/nope/ .*RepositoryNotFound"):
            list_remote(source_client(cfg), parse_url("hf://datasets/org/nope/"))
    assert not any((tmp_path / "users-cache").rglob("*.parquet"))


def test_a_bucket_prefix_is_fetched_shard_by_shard_and_counted_by_its_data_files(tmp_path,
                                                                                 monkeypatch):
    """The job's fetch lands a prefix's first shards until they hold the records asked for; the
    source's bytes count its data files only (a README made a 300-row source "~303 records")."""
    from diag.data import count_records

    folder = _gz_shards(tmp_path / "chat", shards=3, n=100)
    with S3Server() as s3:
        s3.upload(folder, "chat/")
        s3.client().put_object(Bucket=s3.bucket, Key="chat/README.md", Body=b"x" * 5000)
        for name, value in s3.env().items():
            monkeypatch.setenv(name, value)
        cfg = QLoraConfig.quick(source=f"s3://{s3.bucket}/chat/", endpoint_url=s3.endpoint_url,
                                messages_field="messages")
        sizes = [p.stat().st_size for p in sorted(folder.iterdir())]
        for how in ("land", "pull"):
            path, fetched, total = fetch(cfg.source, source_client(cfg), how, tmp_path / how,
                                         records=150)
            assert (fetched, total) == (sum(sizes[:2]), sum(sizes)), how
            assert count_records(path / "part-0.jsonl.gz") == 100
            assert not (path / "part-2.jsonl.gz").exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a whole diag run --quick: 3 min at load 6, over 10 at load 18
def test_diag_run_trains_on_gzipped_chat_shards_in_a_bucket(tmp_path):
    """The whole diagnosis on .jsonl.gz shards of chat records, with a model whose tokenizer
    has a chat template: every step (storage, preflight, token cache, loader sweep, job)."""
    model = tmp_path / "model"
    shutil.copytree(ensure_assets().model_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    with S3Server() as s3:
        s3.upload(_gz_shards(tmp_path / "chat"), "chat-gz/")
        env = {**os.environ, **s3.env(), "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "diag", "run", "--quick", "--source",
                               f"s3://{s3.bucket}/chat-gz/", "--messages-field", "messages",
                               "--model", str(model), "--out", str(tmp_path / "run")],
                              env=env, capture_output=True, text=True, timeout=1150)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "report.html").is_file()
