"""The user's own source: one set of flags (SourceConfig) reaching the job's client, JSONL and
Parquet records (a file or a prefix of shards), and the checks made before anything runs."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from botocore.exceptions import ConnectionClosedError

from diag.cli import main
from diag.config import DiagnoseConfig, ModelLoadConfig, QLoraConfig, SourceConfig, StorageConfig
from diag.data import read_source
from tests.s3proxy import Proxy
from tests.storage.test_storage_cli import NO_AWS

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"q": f"Sort: pear apple {i}", "a": f"apple pear {i}"} for i in range(16)]


def _parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def s3():
    from diag.embedded import S3Server

    with S3Server() as server:
        yield server


def test_each_command_offers_the_source_flags_it_reads_and_refuses_the_others(capsys):
    from diag.cli import parser
    from diag.config.source import BUCKET, MODEL, RECORDS

    def flags(names):
        return {f"--{n.replace('_', '-')}" for n in names} | (
            {"--no-sign-request"} if "sign_request" in names else set())

    every = BUCKET + RECORDS + MODEL
    sub = parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, cls, reads in (("storage", StorageConfig, BUCKET),
                             ("model-load", ModelLoadConfig, MODEL),
                             ("qlora", QLoraConfig, every), ("run", DiagnoseConfig, every)):
        assert issubclass(cls, SourceConfig)
        got = {o for a in sub[name]._actions for o in a.option_strings} & flags(every)
        assert got == flags(reads), name
    for argv, flag in ((["model-load", "--source", "s3://b/k"], "--source"),
                       (["storage", "--model", "org/name"], "--model"),
                       (["storage", "--prompt-field", "q"], "--prompt-field")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"unrecognized arguments: {flag}" in err, err
        assert "reads only these source flags" in err
    with pytest.raises(ValueError, match=r"^ModelLoadConfig.source='s3://b/k': not read here"):
        ModelLoadConfig(source="s3://b/k")  # a notebook's config: refused, not ignored
    assert set(DiagnoseConfig(model="org/name").source_kwargs(StorageConfig)) == set(BUCKET)
    cfg = DiagnoseConfig(source="s3://b/p/", model="org/name", revision="v1", retries=0,
                         prompt_field="q", response_field="a", records=16, job_steps=4)
    from diag.diagnose import job_config

    job = job_config(cfg)
    assert (job.source, job.model, job.revision, job.retries, job.fields(), job.records,
            job.steps) == ("s3://b/p/", "org/name", "v1", 0, {"prompt": "q", "response": "a"},
                           16, 4)


def test_jsonl_and_parquet_read_alike_with_the_named_fields(tmp_path):
    _parquet(tmp_path / "part-0.parquet", ROWS[:8])
    (tmp_path / "part-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[8:]))
    got, problems = read_source(tmp_path, {"prompt": "q", "response": "a"})
    assert got == [{"prompt": r["q"], "response": r["a"]} for r in ROWS] and problems.empty
    text, _ = read_source(tmp_path / "part-0.parquet", {"text": "a"})
    assert text[0] == {"prompt": "", "response": "apple pear 0"}
    bad = tmp_path / "bad"
    bad.mkdir()
    _parquet(bad / "x.parquet", [{"q": "hi", "a": None}, {"q": "yo", "a": "ok"}])
    with pytest.raises(ValueError, match=r"x.parquet: row 1: missing_field"):
        read_source(bad, {"prompt": "q", "response": "a"})
    kept, problems = read_source(bad, {"prompt": "q", "response": "a"}, on_error="skip")
    assert len(kept) == 1 and list(problems["problem"]) == ["missing_field"]


def test_bad_data_names_the_flag(tmp_path):
    _parquet(tmp_path / "d.parquet", ROWS)
    with pytest.raises(ValueError, match=r"^--prompt-field='prompt': no such column in "
                                         r"d.parquet; its columns: q, a$"):
        read_source(tmp_path / "d.parquet", {"prompt": "prompt", "response": "a"})
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"^--source: no readable shard under .*notes.txt"):
        read_source(empty)
    with pytest.raises(ValueError, match="give --text-field alone"):
        QLoraConfig(prompt_field="q")


def _cli(args: list[str], env: dict, cwd: Path, timeout: float = 120
         ) -> tuple[int, str, float]:
    full = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k, v in env.items():
        full.pop(k, None) if v is None else full.__setitem__(k, v)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True,
                          env=full, cwd=cwd, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # its CPU seconds: a busy box's
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime  # wall moves
    return done.returncode, done.stdout + done.stderr, cpu


def test_run_out_on_a_full_folder_fails_fast(tmp_path):
    out = tmp_path / "old-run"
    out.mkdir()
    (out / "report.html").write_text("older run")
    code, text, cpu = _cli(["run", "--out", str(out)], {}, tmp_path)
    assert code == 2 and len(text.strip().splitlines()) == 1 and "not empty" in text
    assert cpu < 2, cpu  # parse time only: nothing imported beyond the configs (torch: 3+ s)
    assert sorted(p.name for p in out.iterdir()) == ["report.html"]


def test_a_local_model_folder_without_weights_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    code, text, _ = _cli(["qlora", "--model", str(folder)], {}, tmp_path)
    assert code == 2 and len(text.strip().splitlines()) == 1
    assert "--model" in text and "*.safetensors" in text
    assert list(tmp_path.iterdir()) == [folder]


def test_profile_and_unsigned_private_bucket_fail_before_anything_runs(s3, tmp_path, monkeypatch,
                                                                      capsys):
    for k, v in NO_AWS.items():
        monkeypatch.delenv(k, raising=False) if v is None else monkeypatch.setenv(k, v)
    s3.client().put_object(Bucket=s3.bucket, Key="private/d.jsonl", Body=b"{}\n")
    out = tmp_path / "run"
    base = ["run", "--quick", "--out", str(out), "--source", f"s3://{s3.bucket}/private/",
            "--endpoint-url", s3.endpoint_url]
    assert main([*base, "--profile", "no-such-profile"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--profile" in err and "no-such-profile" in err
    assert main([*base, "--no-sign-request"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "access denied" in err and "private/" in err
    assert not out.exists()


def test_every_client_flag_reaches_the_jobs_client(s3, tmp_path, monkeypatch):
    from diag.qlora.job import open_sources

    for k, v in NO_AWS.items():
        monkeypatch.delenv(k, raising=False) if v is None else monkeypatch.setenv(k, v)
    creds = tmp_path / "credentials"
    creds.write_text(f"[team]\naws_access_key_id = {s3.access_key}\n"
                     f"aws_secret_access_key = {s3.secret_key}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    proxy = Proxy(s3.port, cut_after=0, cuts=1000)  # every request fails: botocore counts tries
    try:
        for retries in (0, 2):
            cfg = QLoraConfig.quick(source=f"s3://{s3.bucket}/k.jsonl", endpoint_url=proxy.url,
                                    profile="team", region="ap-south-1", retries=retries)
            with open_sources(cfg) as src:
                before = len(proxy.requests)
                with pytest.raises(ConnectionClosedError):
                    src.client.head_object(Bucket=s3.bucket, Key="k.jsonl")
                assert len(proxy.requests) - before == retries + 1
                assert src.client.meta.region_name == "ap-south-1"
                assert src.client.meta.endpoint_url == proxy.url
                got = src.client._request_signer._credentials.access_key  # the profile's
                assert got == s3.access_key
        cfg = cfg.replace(sign_request=False, retries=0)
        with open_sources(cfg) as src:
            from botocore import UNSIGNED

            assert src.client.meta.config.signature_version is UNSIGNED
    finally:
        proxy.close()


@pytest.mark.slow
def test_diag_run_measures_a_parquet_prefix_with_its_fields_in_every_step(s3, tmp_path,
                                                                          _isolated_home):
    # 20 rows: fewer than any loader measurement reads (30 of the embedded dataset's, quick),
    # so every count below is the user's; two shards, so every reader takes a folder
    pytest.importorskip("bitsandbytes")
    from diag import report

    rows = [{"question": f"Sort: pear apple {i}", "answer": f"apple pear {i}"} for i in range(20)]
    client = s3.client()
    for i in range(2):
        local = _parquet(tmp_path / f"part-{i}.parquet", rows[10 * i: 10 * i + 10])
        client.upload_file(str(local), s3.bucket, f"user/sft/part-0000{i}.parquet")
    tokens = _isolated_home / "tokens"
    before = set(tokens.glob("[!.]*"))  # finished caches (a folder each), not the memo
    out = tmp_path / "run"
    code, text, _ = _cli(["run", "--quick", "--out", str(out), "--source",
                          f"s3://{s3.bucket}/user/sft/", "--endpoint-url", s3.endpoint_url,
                          "--prompt-field", "question", "--response-field", "answer"],
                         s3.env(), tmp_path, timeout=600)
    assert code == 0, text[-3000:]
    frames = report.load(out)
    job = frames["qlora"].set_index("plan")
    assert (job["records"] == 12).all() and (job["skipped_records"] == 0).all()  # quick: 12
    # the loader on the job's step: both pipelines over the user's 20 rows, none failed
    sweep = frames["loader"]
    assert set(sweep["pipeline"]) == {"naive", "packed"} and (sweep["records"] == 20).all()
    assert sweep["error"].fillna("").eq("").all()
    stalls = frames["loader_stalls"]  # each shard of the landed folder warmed and evicted
    assert len(stalls) == 2 and stalls["error"].fillna("").eq("").all()
    lines = frames["loader_lines"].set_index("source")  # the line profile: the user's rows
    assert lines.at["record = self.records[i]", "hits"] == 20
    # every token cache this run made (the job's, the loader's) holds the user's fields
    made = [json.loads((f / "meta.json").read_text()) for f in set(tokens.glob("[!.]*")) - before]
    assert made and all(m["fields"] == {"prompt": "question", "response": "answer"}
                        for m in made), [(m["source"], m["fields"]) for m in made]


def test_revision_and_cache_dir_reach_the_jobs_download(tmp_path):
    pytest.importorskip("huggingface_hub")
    import dataclasses

    from huggingface_hub.errors import RevisionNotFoundError

    from diag.qlora import Plan
    from diag.qlora.base import model_folder
    from diag.qlora.job import open_sources

    persistent = dataclasses.replace(Plan.naive(), model_cache="persistent")
    cache = tmp_path / "my-hf-cache"
    with open_sources(QLoraConfig.quick(cache_dir=str(cache))) as src:
        folder = model_folder(persistent, src, tmp_path / "work")
        assert cache in folder.parents and any(folder.glob("*.safetensors"))
        with pytest.raises(RevisionNotFoundError):
            model_folder(Plan.naive(), dataclasses.replace(src, revision="no-such-branch"),
                         tmp_path / "work2")


def test_a_cheap_model_folder_is_timed_until_settled_and_its_extra_downloads_removed(
        tmp_path, monkeypatch):
    # what the model_cache fix is checked on: the embedded model's download (~0.2 s, +-30% on
    # a busy box) is the median of starts timed until it settles, each into a folder of its
    # own; one over the cheap limit (a 7B's minutes) is timed once
    pytest.importorskip("huggingface_hub")
    from diag.noise import MIN_SAMPLES
    from diag.qlora import Plan, base, job

    with job.open_sources(QLoraConfig.quick()) as src:
        folder, seconds = base.timed_folder(Plan.naive(), src, tmp_path)
        seconds = seconds["wall"]
        assert tmp_path in folder.parents and any(folder.glob("*.safetensors"))
        assert [p.name for p in tmp_path.iterdir()] == ["hf-cache"]  # the repeats' are gone
        assert 0 < seconds < base.FOLDER_CHEAP_S
        calls = []
        real = base.model_folder
        monkeypatch.setattr(base, "model_folder", lambda *a: calls.append(a) or real(*a))
        base.timed_folder(Plan.naive(), src, tmp_path / "again")
        assert MIN_SAMPLES <= len(calls) <= base.FOLDER_REPEATS
        calls.clear()
        monkeypatch.setattr(base, "FOLDER_CHEAP_S", 0.0)  # every download "expensive"
        base.timed_folder(Plan.naive(), src, tmp_path / "once")
        assert len(calls) == 1

    now = [0.0]  # the clock timed_folder reads, moved by the starts alone (no scheduler's jitter)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def timed(durations):  # starts that take these seconds in turn
        calls.clear()

        def start(*a):
            calls.append(a)
            now[0] += durations[(len(calls) - 1) % len(durations)]
            return tmp_path

        monkeypatch.setattr(base, "model_folder", start)
        return base.timed_folder(Plan.naive(), src, tmp_path)[1]["wall"]

    monkeypatch.setattr(base, "FOLDER_CHEAP_S", 2.0)
    assert timed([0.02]) == pytest.approx(0.02, rel=0.5) and len(calls) == MIN_SAMPLES
    # a start that moves 3x, turn by turn, never settles: timed until the budget is spent
    monkeypatch.setattr(base, "FOLDER_BUDGET_S", 0.2)
    timed([0.01, 0.03])
    assert MIN_SAMPLES < len(calls) < base.FOLDER_REPEATS


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """The embedded tokenizer with a chat template that begins with {{ bos_token }}, as Llama 2
    chat's, Llama 3's, Mistral's and Gemma's do."""
    from transformers import PreTrainedTokenizerFast

    from diag.embedded import ensure_assets

    folder = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ensure_assets().model_dir)
    tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>"
                               "{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer.save_pretrained(folder)
    return folder


CHAT = [{"role": "user", "content": "Sort: pear apple"},
        {"role": "assistant", "content": "apple pear"}]


def test_a_chat_messages_field_is_rendered_with_the_models_template(tmp_path, chat_tokenizer):
    from diag.data import format_prompt, load_tokenizer
    from diag.embedded import ensure_assets

    _parquet(tmp_path / "c.parquet", [{"conv": CHAT}, {"conv": CHAT[:1]}])
    with pytest.raises(ValueError, match=r"row 2: no_answer"):
        read_source(tmp_path, {"messages": "conv"})
    records, problems = read_source(tmp_path, {"messages": "conv"}, on_error="skip")
    assert records == [{"messages": CHAT}] and list(problems["problem"]) == ["no_answer"]
    plain = load_tokenizer(str(ensure_assets().model_dir))
    if not plain.chat_template:
        with pytest.raises(ValueError, match="^--messages-field: the tokenizer of --model has "
                                             "no chat template"):
            format_prompt(records[0], plain)
    assert format_prompt(records[0], load_tokenizer(str(chat_tokenizer))) == (
        "<s><user>Sort: pear apple\n<assistant>", "apple pear")
    with pytest.raises(ValueError, match="--messages-field alone"):
        QLoraConfig(messages_field="conv", text_field="t")


def test_a_chat_template_with_a_leading_bos_yields_one_bos(tmp_path, chat_tokenizer):
    # the template writes the BOS: the rendered text must not get the tokenizer's added again,
    # in the token cache (both plans of the job, the loader's packed pipeline) nor per sample
    from diag.data import NaiveTextDataset, PackedDataset, build_token_cache, load_tokenizer

    bos = load_tokenizer(str(chat_tokenizer)).bos_token_id
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"conv": CHAT}) + "\n")
    records, _ = read_source(data, {"messages": "conv"})
    cache = build_token_cache(data, chat_tokenizer, fields={"messages": "conv"},
                              cache_dir=tmp_path / "tokens", num_proc=1)
    for name, ids in (("token cache", PackedDataset(cache.folder, 64)[0]["input_ids"]),
                      ("per sample", NaiveTextDataset(records, chat_tokenizer, 64)[0][
                          "input_ids"])):
        assert ids[0] == bos and (ids == bos).sum() == 1, (name, ids[:4].tolist())
    # records the template does not render keep the tokenizer's one BOS
    plain = NaiveTextDataset([{"prompt": "Sort: pear apple", "response": "apple pear"}],
                             chat_tokenizer, 64)[0]["input_ids"]
    assert plain[0] == bos and (plain == bos).sum() == 1


@pytest.mark.parametrize("field", ["text_field", "messages_field"])
def test_a_cpu_runs_projected_loader_sweeps_the_jobs_own_records(field, tmp_path,
                                                                 chat_tokenizer):
    # the diagnosis walked by a runner that makes only the job's inputs (the user's JSONL, the
    # model's tokenizer) and the projected loader; 16 rows, fewer than the sweep reads (30)
    import dataclasses

    from diag import diagnose
    from diag.qlora.measure import JobInputs

    name = {"text_field": "t", "messages_field": "conv"}[field]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"t": f"{r['q']} {r['a']}"} if name == "t" else {
        "conv": [{"role": "user", "content": r["q"]}, {"role": "assistant", "content": r["a"]}]})
        + "\n" for r in ROWS))
    cfg = DiagnoseConfig(device="cpu", storage=False, model_load=False, accum=False,
                         workers=[0], **{field: name})
    inputs = JobInputs(rows_per_step=4, model_dir=chat_tokenizer, data_path=data, device="cpu")

    def run(d, step, make):
        if step is diagnose.JOB:
            return dataclasses.replace(d, job=inputs)
        if step is diagnose.LOADER_PROJECTED:
            return dataclasses.replace(d, loader_projected=make())
        return d  # the job's own measurements and runs: not asked here

    got = diagnose._recipe(cfg, run).loader_projected
    assert set(got.sweep["pipeline"]) == {"naive", "packed"} and (got.sweep["records"] == 16).all()
    assert got.sweep["error"].eq("").all() and got.stalls["error"].eq("").all()
    assert got.lines.set_index("source").at["record = self.records[i]", "hits"] == 16
    assert {d.basis for d in got.decisions} <= {"projected", "default"}


def test_the_cloud_docs_commands_are_accepted_as_written(tmp_path, monkeypatch):
    # docs/cloud.md's commands (continuation lines joined): every flag is its command's and
    # every value one its config takes; the local model folder the doc names exists here
    import shlex

    from diag.cli import parse

    text = (ROOT / "docs" / "cloud.md").read_text().replace("\\\n", " ")
    commands = [line.split("python -m diag ", 1)[1] for line in text.splitlines()
                if line.lstrip("$ ").startswith("python -m diag ")]
    folder = tmp_path / "my-model-folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert len(commands) == 8
    for command in commands:
        name, cfg, _ = parse(shlex.split(command.replace("PORT", "9000")))
        assert command.startswith(name), command


def test_an_out_folder_filled_after_the_config_was_made_is_refused_before_any_step(tmp_path):
    # the config checked --out when it was made (empty then); the run checks it again at its
    # start: with Stop already pressed, anything past that check would stop, not refuse
    import threading

    from diag.diagnose import run_diagnose

    out = tmp_path / "run"
    out.mkdir()
    cfg = DiagnoseConfig.quick(out=str(out))
    (out / "report.html").write_text("another run's")
    stop = threading.Event()
    stop.set()
    with pytest.raises(ValueError, match="the folder is not empty"):
        run_diagnose(cfg, stop=stop)
    assert [p.name for p in out.iterdir()] == ["report.html"]
