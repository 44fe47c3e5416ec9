"""Every refusal before the work: each bad input, typed as a user types it, is one line on stderr
that names the flag or variable, exit 2, before any experiment starts (nothing on stdout, no
progress bar, nothing written; torch and transformers cannot even be imported).

Each table runs in one worker process, case after case through diag.cli.main: one interpreter
start for all of it, torch and transformers made unimportable in it, and the
permission cases real as root too (the worker runs without CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH, so a 0o555 folder is read-only and a 0o000 one unreadable). HERE needs no
server (make check runs it); SERVED runs against the embedded S3 server and hub (slow tier).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAKE_HF_TOKEN
from tests.storage.test_storage_cli import NO_AWS

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "Pw-in-url-42"  # in an endpoint URL: never in the line
E = "--endpoint-url={s3}"
# id, argv (--quick added to a command), environment (None unsets), what the line must name
HERE = [
    ("unknown-command", ["nope"], {}, "'nope'"),
    ("unknown-flag", ["run", "--stepz", "3"], {}, "--stepz"),
    ("not-a-number", ["run", "--records", "x"], {}, "--records"),
    ("not-a-choice", ["storage", "--verify", "md5"], {}, "--verify"),
    ("not-a-scenario", ["model-load", "--scenarios", "cached,warm"], {}, "--scenarios"),
    ("not-a-list", ["run", "--workers", "1,x"], {}, "--workers"),
    ("model-load-source", ["model-load", "--source", "s3://b/k"], {}, "--source"),
    ("storage-model", ["storage", "--model", "org/name"], {}, "--model"),
    ("storage-prompt-field", ["storage", "--prompt-field", "q"], {}, "--prompt-field"),
    ("target-gpu", ["run", "--target-gpu", "GTX 9999"], {}, "--target-gpu"),
    ("current-gpu", ["run", "--current-gpu", "Voodoo 5"], {}, "--current-gpu"),
    ("steps-zero", ["run", "--steps", "0"], {}, "steps=0"),
    ("device", ["run", "--device", "tpu"], {}, "device='tpu'"),
    ("plan", ["run", "--plan", "fast"], {}, "--plan"),
    ("on-error", ["run", "--on-error", "ignore"], {}, "on_error='ignore'"),
    ("micro-batches", ["run", "--micro-batches", "0"], {}, "micro_batches=[0]"),
    ("seq-len-negative", ["run", "--seq-len=-1"], {}, "seq_len=-1"),
    ("retries-negative", ["storage", "--source", "s3://b/k", "--retries=-1"], {}, "retries=-1"),
    ("records-vs-job-steps", ["run", "--records", "3", "--job-steps", "5"], {}, "--job-steps=5"),
    ("records-vs-steps", ["qlora", "--records", "3", "--steps", "5"], {}, "steps=5"),
    ("revision-empty", ["model-load", "--revision", ""], {}, "revision=''"),
    ("source-not-s3", ["run", "--source", "http://b/k"], {}, "source='http://b/k'"),
    ("source-no-bucket", ["run", "--source", "s3://"], {}, "source='s3://'"),
    ("endpoint-without-source", ["run", "--endpoint-url", "http://127.0.0.1:9"], {},
     "--endpoint-url"),
    ("profile-without-source", ["storage", "--profile", "team"], {}, "--profile"),
    ("unsigned-without-source", ["run", "--no-sign-request"], {}, "--no-sign-request"),
    ("endpoint-not-a-url", ["run", "--source", "s3://diag/d.jsonl", "--endpoint-url",
                            "not-a-url"], {}, "--endpoint-url='not-a-url'"),
    ("region-with-a-space", ["run", "--source", "s3://diag/d.jsonl", "--region", "eu west"],
     {}, "--region='eu west'"),
    ("prompt-without-response", ["run", "--prompt-field", "q"], {}, "--prompt-field"),
    ("two-kinds-of-field", ["qlora", "--text-field", "t", "--messages-field", "m"], {},
     "--text-field"),
    ("model-no-such-folder", ["run", "--model", "./nope"], {}, "--model"),
    ("model-bad-id", ["model-load", "--model", "bad id!"], {}, "--model"),
    ("model-without-weights", ["model-load", "--model", "{no_weights}"], {}, "--model"),
    ("model-pickle-weights", ["model-load", "--model", "{pickles}"], {}, "--model"),
    ("model-unreadable", ["model-load", "--model", "{unreadable}"], {}, "--model"),
    ("offline-fresh", ["model-load", "--scenarios", "fresh"], {"HF_HUB_OFFLINE": "1"},
     "HF_HUB_OFFLINE"),
    ("home-a-file", ["run"], {"DIAG_HOME": "{file}"}, "DIAG_HOME"),
    ("home-under-a-file", ["storage"], {"DIAG_HOME": "{file}/diag"}, "DIAG_HOME"),
    ("home-read-only", ["model-load"], {"DIAG_HOME": "{read_only}/diag"}, "DIAG_HOME"),
    ("home-unreadable", ["qlora"], {"DIAG_HOME": "{unreadable}"}, "DIAG_HOME"),
    ("cache-dir-a-file", ["model-load", "--cache-dir", "{file}"], {}, "--cache-dir"),
    ("cache-dir-read-only", ["model-load", "--cache-dir", "{read_only}"], {}, "--cache-dir"),
    ("local-dir-a-file", ["storage", "--local-dir", "{file}"], {}, "--local-dir"),
    ("local-dir-under-a-file", ["storage", "--local-dir", "{file}/land"], {}, "--local-dir"),
    ("local-dir-read-only", ["storage", "--local-dir", "{read_only}"], {}, "--local-dir"),
    ("out-dir-under-a-file", ["qlora", "--out-dir", "{file}/checkpoints"], {}, "--out-dir"),
    ("out-not-empty", ["run", "--out", "{full}"], {}, "--out"),
    ("out-a-file", ["run", "--out", "{file}"], {}, "--out"),
    ("out-under-a-file", ["run", "--out", "{file}/run"], {}, "--out"),
    ("out-read-only", ["run", "--out", "{read_only}/run"], {}, "--out"),
]
# these need the embedded S3 server or hub, or tokenize records: the slow tier
SERVED = [
    ("model-not-on-the-hub", ["model-load", "--model", "diag-local/no-such-model"], {},
     "--model='diag-local/no-such-model': no such model"),
    ("revision-not-on-the-hub", ["qlora", "--model", "{repo}", "--revision", "no-such-branch"],
     {}, "--revision='no-such-branch'"),
    ("no-such-bucket", ["run", "--source", "s3://no-such-bucket/d.jsonl", E], {}, "--source"),
    ("empty-prefix", ["run", "--source", "s3://diag/nothing/", E], {}, "--source"),
    ("no-readable-shard", ["run", "--source", "s3://diag/notes/", E], {}, "--source"),
    ("no-such-object", ["run", "--source", "s3://diag/missing.jsonl", E], {}, "--source"),
    ("no-such-profile", ["run", "--source", "s3://diag/d.jsonl", E, "--profile", "nobody"], {},
     "--profile"),
    ("no-credentials", ["storage", "--source", "s3://diag/d.jsonl", E],
     {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, "--no-sign-request"),
    ("unsigned-private-bucket", ["run", "--source", "s3://diag/private/", E,
                                 "--no-sign-request"], {}, "drop --no-sign-request"),
    ("endpoint-down", ["storage", "--source", "s3://diag/d.jsonl", "--retries", "0",
                       f"--endpoint-url=http://user:{PASSWORD}@127.0.0.1:9"], {}, "--endpoint-url"),
    # the job's records, read and tokenized as the job does (pyarrow, json, tokenizers)
    ("missing-column", ["run", "--source", "s3://diag/sft/", E, "--prompt-field", "prompt",
                        "--response-field", "answer"], {}, "--prompt-field='prompt'"),
    ("not-parquet", ["run", "--source", "s3://diag/fake/", E], {}, "--source"),
    ("bad-json-line", ["qlora", "--source", "s3://diag/bad-line.jsonl", E], {}, "--source"),
    ("seq-len-no-record-fits", ["run", "--source", "s3://diag/long.jsonl", E, "--seq-len", "16"],
     {}, "--seq-len=16"),
    ("fewer-records-than-steps", ["run", "--source", "s3://diag/three.jsonl", E, "--records",
                                  "8", "--job-steps", "5"], {}, "steps=5"),
    ("jsonl-missing-field", ["run", "--source", "s3://diag/qa.jsonl", E, "--prompt-field",
                             "prompt", "--response-field", "answer"], {},
     "--prompt-field='prompt': no such field; its fields: question, answer"),
    ("truncated-parquet", ["run", "--source", "s3://diag/cut/", E], {}, "not a readable Parquet"),
    ("gz-bad-json-line", ["qlora", "--source", "s3://diag/bad-line.jsonl.gz", E], {},
     "bad-line.jsonl: line 2: invalid_json"),
    ("no-chat-template", ["run", "--source", "s3://diag/chat.jsonl", E, "--messages-field",
                          "messages"], {}, "--messages-field"),
    ("results-of-another-job", ["train", "--source", "s3://diag/d.jsonl", E, "--results",
                                "{results}", "--out-dir", "{tmp}/train-out"], {},
     "results='{results}' was measured on seq_len 512"),
]
NOT_SAID = {"unsigned-private-bucket": "needs --no-sign-request"}  # the hint it must not give


def _alpaca(i: int, words: int = 3) -> str:
    return json.dumps({"instruction": "sort " + "pear " * words + str(i), "input": "",
                       "output": "apple pear"}) + "\n"


def _bucket(s3, folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    client = s3.client()
    pq.write_table(pa.Table.from_pylist([{"question": f"q{i}", "answer": f"a{i}"}
                                         for i in range(16)]), folder / "part-00000.parquet")
    client.upload_file(str(folder / "part-00000.parquet"), s3.bucket, "sft/part-00000.parquet")
    objects = {"fake/part-0.parquet": b"not a parquet file\n", "notes/readme.txt": b"notes\n",
               "private/d.jsonl": _alpaca(0).encode(), "d.jsonl": _alpaca(0).encode(),
               "bad-line.jsonl": (_alpaca(0) + "{not json\n").encode(),
               "long.jsonl": "".join(_alpaca(i, words=40) for i in range(4)).encode(),
               "three.jsonl": "".join(_alpaca(i) for i in range(3)).encode(),
               "qa.jsonl": b'{"question": "q", "answer": "a"}\n' * 4,
               "cut/part-0.parquet": (folder / "part-00000.parquet").read_bytes()[:300],
               "bad-line.jsonl.gz": gzip.compress((_alpaca(0) + "{not json\n").encode()),
               "chat.jsonl": json.dumps({"messages": [{"role": "user", "content": "hi"}, {
                   "role": "assistant", "content": "yo"}]}).encode() + b"\n"}
    for key, body in objects.items():
        client.put_object(Bucket=s3.bucket, Key=key, Body=body)


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, Path]:
    """A folder of bad places: a file, a full run folder, a read-only and an unreadable folder
    (made so by the worker's lack of override, as root), model folders without safetensors."""
    tmp = tmp_path_factory.mktemp("refusals")
    tmp.chmod(0o755)
    places = {"tmp": tmp, "file": tmp / "a-file", "full": tmp / "full",
              "read_only": tmp / "read-only", "unreadable": tmp / "unreadable",
              "no_weights": tmp / "no-weights", "pickles": tmp / "pickles",
              "results": tmp / "results"}
    places["file"].write_text("x")
    for name in ("full", "read_only", "unreadable", "no_weights", "pickles", "results"):
        places[name].mkdir()
    from diag.decision import Decision, MeasuredOn, frame

    other = MeasuredOn(model="the embedded tiny Llama + LoRA r=8", seq_len=512)
    frame([Decision.from_rows("micro_batch", 4, "x", [{}], source="accum", measured_on=other)]
          ).to_csv(places["results"] / "decisions.csv", index=False)
    (places["full"] / "report.html").write_text("an older run")
    for folder in (places["no_weights"], places["pickles"]):
        (folder / "config.json").write_text("{}")
    (places["pickles"] / "pytorch_model.bin").write_bytes(b"pickle")
    places["read_only"].chmod(0o555)
    places["unreadable"].chmod(0o000)
    yield places
    places["read_only"].chmod(0o755)
    places["unreadable"].chmod(0o755)


@pytest.fixture(scope="module")
def refused_here(places):
    """The outcome of each HERE case: {id: {rc, err, out, seconds, torch}}."""
    return _table(HERE, places, {"HF_ENDPOINT": "http://127.0.0.1:9"})


@pytest.fixture(scope="module")
def refused_served(places):
    """The outcome of each SERVED case, against the embedded S3 server and hub."""
    from diag.embedded import HubServer, S3Server, ensure_assets

    assets = ensure_assets()
    with S3Server() as s3, HubServer(assets.hub_root) as hub:
        _bucket(s3, places["tmp"])
        return _table(SERVED, places, {"HF_ENDPOINT": hub.endpoint, "s3": s3.endpoint_url,
                                       "repo": assets.repo_id})


def _table(cases: list, places: dict[str, Path], more: dict[str, str]) -> dict[str, dict]:
    """Each case run by the worker (one process; as root, without the file overrides)."""
    from diag.embedded import S3Server

    tmp = places["tmp"]
    values = {**{k: str(v) for k, v in places.items()}, **more}
    table = [{"id": i, "argv": [a.format(**values) for a in argv]
              + (["--quick"] if argv[0] != "nope" else []),
              "env": {k: v if v is None else v.format(**values) for k, v in env.items()}}
             for i, argv, env, _ in cases]
    name = "served" if cases is SERVED else "here"
    (tmp / f"{name}.json").write_text(json.dumps(table))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": more["HF_ENDPOINT"],
           "HF_HUB_CACHE": str(tmp / "empty-hf-cache"), "AWS_ACCESS_KEY_ID": S3Server.access_key,
           "AWS_SECRET_ACCESS_KEY": S3Server.secret_key}
    for k, v in NO_AWS.items():
        if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.pop(k, None) if v is None else env.__setitem__(k, v)
    env.pop("DIAG_DEBUG", None)
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from tests.test_refusals import work; "
         "work(*sys.argv[1:])", str(tmp / f"{name}.json"), str(tmp / f"{name}-got.json"),
         str(tmp)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        preexec_fn=_without_root_override if os.geteuid() == 0 else None)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp / f"{name}-got.json").read_text())


def _without_root_override() -> None:
    """In the worker, before exec: root keeps every capability but the two that let it read and
    write any file, so permissions hold for it as for a user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0):  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


class _Overran(BaseException):
    """A case that was not refused: stopped, so the table goes on."""


def work(table: str, out: str, cwd: str) -> None:
    """The worker: each case through diag.cli.main in this process, its stderr and stdout kept."""
    import contextlib
    import io
    import signal
    import time

    for blocked in ("torch", "transformers"):  # `import torch` raises from here on
        sys.modules[blocked] = None  # type: ignore[assignment]
    from diag.cli import main

    def overran(signum: int, frame: object) -> None:
        raise _Overran

    signal.signal(signal.SIGALRM, overran)
    os.chdir(cwd)
    got = {}
    for case in json.loads(Path(table).read_text()):
        saved = dict(os.environ)
        for k, v in case["env"].items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        err, printed = io.StringIO(), io.StringIO()
        start = time.perf_counter()
        signal.alarm(60)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(printed):
                rc: int | str = main(case["argv"])
        except _Overran:
            rc = "not refused within 60 s"
        finally:
            signal.alarm(0)
        got[case["id"]] = {"rc": rc, "err": err.getvalue(), "out": printed.getvalue(),
                           "seconds": time.perf_counter() - start}
        os.environ.clear()
        os.environ.update(saved)
    Path(out).write_text(json.dumps(got))


def _one_line_naming(token: str, case: str, got: dict) -> None:
    lines = got["err"].strip().splitlines()
    assert got["rc"] == 2 and got["out"] == "" and len(lines) == 1, got
    line = lines[0]
    assert line.startswith(("diag", "python -m diag")) and token in line, line
    assert FAKE_HF_TOKEN not in line and PASSWORD not in line and "Traceback" not in line
    assert NOT_SAID.get(case, "\0") not in line, line


@pytest.mark.xdist_group("refusals")
@pytest.mark.parametrize("case, token", [(c[0], c[3]) for c in HERE], ids=[c[0] for c in HERE])
def test_a_bad_setting_is_one_line_naming_it_exit_2_before_any_work(refused_here, case, token):
    _one_line_naming(token, case, refused_here[case])


@pytest.mark.slow
@pytest.mark.xdist_group("refusals")
@pytest.mark.parametrize("case, token", [(c[0], c[3]) for c in SERVED],
                         ids=[c[0] for c in SERVED])
def test_a_bad_source_or_model_is_one_line_naming_it_exit_2_before_any_work(refused_served, case,
                                                                            token, places):
    _one_line_naming(token.format(**{k: str(v) for k, v in places.items()}), case,
                     refused_served[case])


@pytest.mark.slow
@pytest.mark.xdist_group("refusals")
def test_a_refused_train_writes_nothing(refused_served, places):
    assert refused_served["results-of-another-job"]["rc"] == 2
    assert not (places["tmp"] / "train-out").exists()
