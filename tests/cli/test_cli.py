import dataclasses
import subprocess
import sys

import pytest

from diag.cli import EXPERIMENTS, main, parse
from diag.cli.flags import field_docs
from diag.config import ModelLoadConfig, StorageConfig, ToyConfig


def run_cli(*args, env_extra=None):
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_help_lists_working_experiments():
    out = run_cli("--help")
    assert out.returncode == 0
    for name in EXPERIMENTS:
        assert name in out.stdout


def test_flags_come_from_the_config_dataclass():
    name, cfg, _ = parse(["toy", "--steps", "7", "--prep-ms", "1.5", "--device", "cpu"])
    assert name == "toy"
    assert isinstance(cfg, ToyConfig)
    # DIAG_QUICK=1 in tests: unset fields take the quick defaults
    assert cfg == ToyConfig.quick(steps=7, prep_ms=1.5, device="cpu")
    _, cfg, _ = parse(["info", "--no-probe"])
    assert cfg.probe is False


@pytest.mark.slow
def test_info_prints_the_device_table():
    out = run_cli("info", "--quick")
    assert out.returncode == 0, out.stderr
    assert "cpu_model" in out.stdout and "peak_tflops_" in out.stdout


def test_every_table_experiment_takes_the_same_output_flags():
    for name, exp in EXPERIMENTS.items():
        positional = {"report": ["x"], "attach": ["1"], "trace": [__file__]}.get(name, [])
        _, _, args = parse([name, "--quick"] + positional)
        assert hasattr(args, "csv") == hasattr(args, "json") == hasattr(args, "report") == exp.table


@pytest.mark.slow
def test_json_and_report_come_from_main_for_a_dataclass_result(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)  # --report writes runs/<id>/ under the working directory
    out = run_cli("storage", "--quick", "--size-mb", "1", "--repeats", "1", "--land", "--json",
                  "--report")
    assert out.returncode == 0, out.stderr
    tables = json.loads(out.stdout)  # stdout is JSON only: the folder line goes to stderr
    assert set(tables) == {"storage", "storage_tax", "advice", "decisions", "storage_sample"}
    assert tables["decisions"][0]["setting"] == "fetch"
    assert {"boto3_default", "land", "local_read"} <= {r["method"] for r in tables["storage"]}
    assert tables["advice"][0]["stage"] == "fetch_data"
    folder = next((tmp_path / "runs").iterdir())
    assert {"storage.csv", "storage_tax.csv", "advice.csv", "report.html"} <= {
        p.name for p in folder.iterdir()}
    assert f"wrote {folder / 'report.html'}" in out.stderr


def test_toy_report_finds_the_stage_frame_under_the_one_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["toy", "--quick", "--steps", "3", "--report"]) == 0
    folder = next((tmp_path / "runs").iterdir())
    names = {p.name for p in folder.iterdir()}
    assert {"run.csv", "stage_shares.png", "amdahl.png"} <= names, names


def test_toy_runs_and_writes_csv(tmp_path):
    csv = tmp_path / "toy.csv"
    assert main(["toy", "--quick", "--steps", "3", "--csv", str(csv)]) == 0
    text = csv.read_text()
    assert text.startswith("stage,seconds,step,rank")
    assert text.count("compute") == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope"], "invalid choice: 'nope'"),
        (["toy", "--stepz", "3"], "unrecognized arguments: --stepz"),
        (["toy", "--steps", "0"], "ToyConfig.steps=0: must be a number > 0"),
        (["toy", "--steps", "x"], "invalid int value: 'x'"),
        (["toy", "--device", "tpu"], "allowed values are 'auto', 'cpu', 'cuda'"),
        (["storage", "--verify", "md5"], "invalid choice: 'md5' (choose from 'sha256', 'size')"),
        (["model-load", "--scenarios", "cached,warm"], "'warm' is not one of fresh, cached"),
        ([], "name an experiment"),
    ],
)
def test_user_errors_are_one_line_exit_2(args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert message in lines[0]
    assert "Traceback" not in out.stderr


def test_under_a_launcher_a_one_process_command_is_refused_in_one_line_naming_the_rank(
        monkeypatch, capsys):
    # what `torchrun --nproc_per_node 2 -m diag run` gives rank 1: its own line, no work done
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert main(["run", "--no-storage"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("diag: rank 1 (node 0): `diag run` runs in one process, not under a "
                           "launcher (WORLD_SIZE=2): run it alone on one GPU, then launch the job")
    assert "torchrun --nproc_per_node N -m diag qlora --report" in line
    assert [name for name, e in EXPERIMENTS.items() if e.ddp] == ["toy", "accum", "qlora"]


def test_secrets_never_reach_cli_output(monkeypatch):
    secret = "sk-very-secret-token-123"
    out = run_cli("toy", "--device", "tpu", secret, env_extra={"HF_TOKEN": secret})
    assert out.returncode == 2
    assert secret not in out.stderr + out.stdout


def test_the_advice_lines_are_redacted_like_the_tables(capsys):
    # a finding's evidence may quote a source URL with its credentials
    import argparse

    import pandas as pd

    from diag.cli import show
    from diag.secrets import register

    secret = "sk-advice-secret-456"
    register(secret)
    advice = pd.DataFrame({"stage": ["fetch_data"], "finding": ["land it"],
                           "seconds_saved": [1.5], "evidence": [f"s3://u:{secret}@host/x"]})
    result = dataclasses.make_dataclass("Result", ["frame", "advice"])(
        pd.DataFrame({"method": ["boto3"]}), advice)
    show("storage", StorageConfig(), result, argparse.Namespace(csv=None, json=False))
    out = capsys.readouterr().out
    assert "land it: saves 1.5 s per start" in out and secret not in out


def test_csv_only_where_the_result_is_tables():
    out = run_cli("run", "--csv", "x.csv")
    assert out.returncode == 2 and "unrecognized arguments: --csv" in out.stderr


@pytest.mark.slow
def test_sigterm_stops_the_embedded_servers(tmp_path):
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "diag", "storage", "--quick"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline, servers = time.perf_counter() + 60, []
        while not servers and time.perf_counter() < deadline:
            servers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                       if "moto.server" in " ".join(c.cmdline())]
            time.sleep(0.1)
        assert servers, "the storage experiment never started its S3 server"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(servers, timeout=10)
        assert not alive
    finally:
        proc.kill()


def test_help_shows_each_fields_comment_and_its_choices(capsys):
    with pytest.raises(SystemExit) as done:
        main(["storage", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--verify {sha256,size} land() hit check: \"sha256\" catches flipped bytes" in text
    assert "(default: 'sha256')" in text
    with pytest.raises(SystemExit):
        main(["model-load", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--scenarios {fresh,cached,cached_offline,cached_cold},..." in text


def test_every_config_field_has_a_comment_for_help():
    for name, exp in EXPERIMENTS.items():
        docs = field_docs(exp.config)
        missing = [f.name for f in dataclasses.fields(exp.config) if not docs.get(f.name)]
        assert not missing, f"{name}: fields without a trailing comment: {missing}"
    assert field_docs(StorageConfig)["retries"].startswith("request retries and re-GETs")


def test_a_wrapped_field_comment_is_one_help_text():
    from dataclasses import dataclass

    @dataclass
    class Wrapped:
        first: int = 1  # starts here,
                        # goes on here
        # about the next field (at the field's indent): not part of first's help
        second: int = 2  # alone

    assert field_docs(Wrapped) == {"first": "starts here, goes on here", "second": "alone"}


def test_literal_fields_parse_to_their_allowed_values():
    _, cfg, _ = parse(["model-load", "--scenarios", "cached, cached_cold", "--device", "cuda:1"])
    assert cfg == ModelLoadConfig.quick(scenarios=["cached", "cached_cold"], device="cuda:1")
    _, cfg, _ = parse(["storage", "--verify", "size"])
    assert cfg.verify == "size"


def test_version(capsys):
    import diag

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"diag {diag.__version__} (python ")


def test_a_password_in_a_url_never_reaches_the_error_line(capsys):
    # the value lands in the one-line error (it names what was given): its userinfo must not
    assert main(["toy", "--device", "http://admin:pa55word-xyz@10.0.0.1:9000"]) == 2
    err = capsys.readouterr().err
    assert "pa55word-xyz" not in err and "http://***@10.0.0.1:9000" in err


def test_a_finished_run_exits_without_teardown_but_with_everything_a_normal_exit_does(tmp_path):
    import os

    # exit_now skips the interpreter's teardown; what a normal exit still does must happen:
    # a thread that is not a daemon finishes, atexit handlers run, Python's and C's buffered
    # output reach a pipe, and the exit code is kept
    script = (
        "import atexit, ctypes, threading, time\n"
        "from diag.cli import exit_now\n"
        "def late():\n"
        "    time.sleep(0.3)\n"
        "    print('thread', flush=True)\n"
        "threading.Thread(target=late).start()\n"
        "atexit.register(lambda: print('atexit'))\n"
        "ctypes.CDLL(None).printf(b'c-buffer\\n')\n"
        "print('python-buffer')\n"
        "exit_now(3)\n")
    # buffered, as a CLI's output to a pipe is (PYTHONUNBUFFERED would unbuffer C's stdout too)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 3, out.stderr
    assert sorted(out.stdout.split()) == ["atexit", "c-buffer", "python-buffer", "thread"]
    assert out.stdout.index("thread") < out.stdout.index("atexit")  # joined before the handlers
