"""diag.secrets: every route a credential takes into text is redacted, and nothing else is."""

from __future__ import annotations

import codecs
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from diag import secrets
from diag.secrets import redact, redact_frame, register


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """No real token file, AWS profile or earlier registration leaks into a test."""
    monkeypatch.setattr(secrets, "_registered", set())
    monkeypatch.setattr(secrets, "_cache", {})
    # as in a process that made no S3 client yet (an earlier test in this worker may have made
    # one with given keys, after which redaction rightly walks no credential chain)
    monkeypatch.setattr(secrets, "_aws_clients", None)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never wait for an instance role


def test_registered_values_are_redacted_without_any_env_var():
    assert redact("key=plain-value-42 end") == "key=plain-value-42 end"
    register("plain-value-42", "short", None)
    assert redact("key=plain-value-42 end") == "key=*** end"
    assert redact("short stays") == "short stays"  # under 6 characters: would mangle text


def test_secret_named_env_vars_are_redacted_others_are_not(monkeypatch):
    monkeypatch.setenv("MY_API_KEY", "value-from-env-1")
    monkeypatch.setenv("MY_REGION", "region-value-2")
    assert redact("a value-from-env-1 b region-value-2") == "a *** b region-value-2"


def test_longest_secret_first():
    register("abcdef", "abcdefghij")
    assert redact("x abcdefghij y") == "x *** y"


@pytest.mark.parametrize("text, expected", [
    ("token hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567 used", "token *** used"),
    ("key AKIAIOSFODNN7EXAMPLE,", "key ***,"),
    ("temp ASIAXYZXYZXYZXYZXYZ1 done", "temp *** done"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
     "&X-Amz-Credential=AKIDEXAMPLE%2F20260101%2Fus-east-1%2Fs3%2Faws4_request"
     "&X-Amz-Signature=0a1b2c3d4e5f&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
     "&X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"),
    ("X-Amz-Security-Token=IQoJb3JpZ2luX2VjEJr%2F end", "X-Amz-Security-Token=*** end"),
    ("connect to http://user:p4ss@host:9000/x failed", "connect to http://***@host:9000/x failed"),
    ("endpoint https://tok3n@hub.example/api", "endpoint https://***@hub.example/api"),
])
def test_credential_shapes_are_redacted(text, expected):
    assert redact(text) == expected


@pytest.mark.parametrize("text", [
    "s3://my-bucket/datasets/sft/part-0001.parquet",
    "https://huggingface.co/meta-llama/Llama-2-7b-hf",
    "mail admin@example.com about AKIA and hf_short",
    "AKIAIOSFODNN7EXAMPLEX is too long to be a key id",
    "model_load stage hf_cache 0.25 s",
])
def test_ordinary_text_is_left_alone(text):
    assert redact(text) == text


def test_hf_token_file_written_by_login_is_redacted(monkeypatch, tmp_path):
    token = "oauth-style-token-without-prefix-9"  # no hf_ shape: only the file can tell
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(token + "\n")
    assert redact(f"header {token}") == "header ***"
    (tmp_path / "hf" / "stored_tokens").write_text(
        "[work]\nhf_token = another-stored-token-77\n\n[home]\nhf_token = third-token-88\n")
    assert redact("another-stored-token-77 third-token-88") == "*** ***"
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "elsewhere"))  # hf's override
    (tmp_path / "elsewhere").write_text("token-at-custom-path\n")
    assert redact("token-at-custom-path") == "***"
    (tmp_path / "elsewhere").write_text("rotated-token-value-xyz\n")  # re-login: file changes
    assert redact("rotated-token-value-xyz") == "***"


def test_aws_profile_credentials_are_redacted_once_resolved(monkeypatch, tmp_path):
    access, secret = "TESTKEYID1234567", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzEXAMPLE"
    creds = tmp_path / "credentials"
    creds.write_text(f"[team]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "team")
    import boto3  # noqa: F401  (a process that uses boto3 is one whose text may hold its keys)

    assert redact(f"id {access} secret {secret}") == "id *** secret ***"


def test_resolution_is_cached(monkeypatch):
    import boto3  # noqa: F401

    calls = []
    monkeypatch.setattr(secrets, "_aws_credentials", lambda: calls.append(1))
    for _ in range(50):
        redact("some text")
    assert len(calls) == 1
    monkeypatch.setenv("AWS_PROFILE", "other")  # a different profile is resolved again
    redact("some text")
    assert len(calls) == 2


def test_redact_frame_redacts_text_cells_only():
    register("frame-secret-123")
    frame = pd.DataFrame({"method": ["http://u:pw@h/x", "frame-secret-123 here", "plain"],
                          "seconds": [1.0, 2.0, 3.0]})
    out = redact_frame(frame)
    assert list(out["method"]) == ["http://***@h/x", "*** here", "plain"]
    assert list(out["seconds"]) == [1.0, 2.0, 3.0]
    assert frame.loc[1, "method"] == "frame-secret-123 here"  # the input is not changed


def test_six_characters_is_long_enough_from_every_source(monkeypatch, tmp_path):
    register("reg6ch", "reg5c")
    monkeypatch.setenv("MY_TOKEN", "env6ch")
    monkeypatch.setenv("OTHER_TOKEN", "env5c")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text("fil6ch\n")
    (tmp_path / "hf" / "stored_tokens").write_text("[short]\nhf_token = fil5c\n")
    assert redact("reg6ch env6ch fil6ch") == "*** *** ***"
    assert redact("reg5c env5c fil5c") == "reg5c env5c fil5c"  # 5: too short to be worth it


def test_a_secret_inside_a_longer_one_does_not_leave_pieces():
    register("token-42", "a-token-42-long")  # the longer one sorts first by length, not by text
    assert redact("x a-token-42-long y") == "x *** y"


def test_explicit_values_are_the_ones_redacted():
    assert redact("x given-value-2 y", ["given-value-2"]) == "x *** y"


def test_hf_token_under_xdg_cache_home_or_home_cache(monkeypatch, tmp_path):
    """No HF_HOME: hf keeps its token in $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface."""
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "xdg" / "huggingface").mkdir(parents=True)
    (tmp_path / "xdg" / "huggingface" / "token").write_text("token-under-xdg-1\n")
    (tmp_path / "home" / ".cache" / "huggingface").mkdir(parents=True)
    (tmp_path / "home" / ".cache" / "huggingface" / "token").write_text("token-in-home-2\n")
    assert redact("token-under-xdg-1 token-in-home-2") == "*** token-in-home-2"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert redact("token-under-xdg-1 token-in-home-2") == "token-under-xdg-1 ***"


def test_hf_token_where_an_imported_huggingface_hub_looks(monkeypatch, tmp_path):
    """huggingface_hub fixes its token path at import (staging mode moves it): redact that too."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "staging" / "token"))
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "token").write_text("token-hub-knows-3\n")
    (tmp_path / "staging" / "stored_tokens").write_text("[ci]\nhf_token = stored-by-hub-4\n")
    assert redact("token-hub-knows-3 stored-by-hub-4") == "*** ***"


def test_stored_tokens_keep_equals_signs_and_only_hf_token_lines(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "stored_tokens").write_text(
        "[padded]\nhf_token = tok=en=value==\nnote = ordinary words here\n")
    assert redact("tok=en=value== ordinary words here") == "*** ordinary words here"


def test_token_file_is_utf8_under_an_ascii_locale(tmp_path):
    """A token named with an accent must not hide the file from a process whose locale is ASCII."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "stored_tokens").write_text("[équipe]\nhf_token = team-token-5\n",
                                                  encoding="utf-8")
    assert redact("team-token-5") == "***"  # this process (UTF-8 locale or mode)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0",
               PYTHONPATH=str(Path(secrets.__file__).parents[1]))
    code = ("import codecs, locale; from diag.secrets import redact; "
            "print(codecs.lookup(locale.getpreferredencoding(False)).name, redact('team-token-5'))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    encoding, shown = run.stdout.split()
    if codecs.lookup(encoding).name == "utf-8":
        pytest.skip("this platform's C locale is UTF-8: the ASCII case cannot be shown")
    assert shown == "***"


def _aws_section(name: str, n: int) -> str:
    return (f"[{name}]\naws_access_key_id = TESTKEYID{n}000000\n"
            f"aws_secret_access_key = secret/{n}/wJalrXUtnFEMIK7MDENG\n")


@pytest.mark.parametrize("variable", ["AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE",
                                      "AWS_CONFIG_FILE"])
def test_switching_what_boto3_reads_redacts_the_new_credentials(monkeypatch, tmp_path, variable):
    import boto3  # noqa: F401

    (tmp_path / "profiles").write_text(_aws_section("p1", 1) + _aws_section("p2", 2))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "profiles"))
    for n in (1, 2):
        (tmp_path / f"file{n}").write_text(_aws_section("default", n))
        value = f"p{n}" if variable == "AWS_DEFAULT_PROFILE" else str(tmp_path / f"file{n}")
        monkeypatch.setenv(variable, value)
        assert redact(f"TESTKEYID{n}000000 secret/{n}/wJalrXUtnFEMIK7MDENG") == "*** ***", n


def test_boto3_imported_after_a_first_redact_is_resolved_then(monkeypatch, tmp_path):
    import boto3

    (tmp_path / "creds").write_text(_aws_section("default", 7))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "creds"))
    monkeypatch.delitem(sys.modules, "boto3")
    assert redact("secret/7/wJalrXUtnFEMIK7MDENG") == "secret/7/wJalrXUtnFEMIK7MDENG"
    monkeypatch.setitem(sys.modules, "boto3", boto3)  # the process starts using boto3
    assert redact("secret/7/wJalrXUtnFEMIK7MDENG") == "***"


def test_aws_credentials_add_to_the_hf_token(monkeypatch, tmp_path):
    import boto3  # noqa: F401

    (tmp_path / "creds").write_text(_aws_section("default", 8))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "creds"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text("hf-file-token-8\n")
    assert redact("hf-file-token-8 secret/8/wJalrXUtnFEMIK7MDENG") == "*** ***"


def test_redact_frame_mixed_cells_and_one_lookup(monkeypatch):
    register("frame-secret-123")
    lookups = []
    known = secrets.secret_values
    monkeypatch.setattr(secrets, "secret_values", lambda: lookups.append(1) or known())
    frame = pd.DataFrame({"note": ["frame-secret-123 x", 7, None] * 20})  # object, not all str
    out = redact_frame(frame)
    assert list(out["note"][:3]) == ["*** x", 7, None]
    # each lookup stats the token files: once per cell would crawl on a big table
    assert len(lookups) == 1


@pytest.fixture
def imds(monkeypatch):
    """A loopback instance metadata service that counts the requests it gets (and has no role)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(f"{self.command} {self.path}")
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    monkeypatch.setattr(secrets, "_aws_clients", None)
    yield seen
    server.shutdown()


def test_redaction_asks_the_metadata_service_only_when_the_chain_may_end_there(imds, monkeypatch):
    import boto3  # noqa: F401  a process that uses boto3

    from diag.storage.objectstore import make_client

    redact("x")  # nothing given, nothing disabled: the chain ends at the instance role
    assert imds, "the control: the credential chain did reach the loopback metadata service"
    imds.clear()
    monkeypatch.setattr(secrets, "_cache", {})
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "1")  # botocore alone reads "true" only
    assert redact("x") == "x" and imds == []
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    monkeypatch.setattr(secrets, "_cache", {})
    make_client("http://127.0.0.1:9", credentials={"aws_access_key_id": "AKIDGIVEN0000001",
                                                   "aws_secret_access_key": "given/secret/42"})
    assert redact("a given/secret/42 b") == "a *** b" and imds == []  # keys given: no chain


def test_render_redacts_a_secret_registered_after_the_folder_was_written(tmp_path):
    # a run folder written before a value was known secret (its CSV holds it), rendered again
    # once it is registered: the page never shows it
    from diag import report

    frame = pd.DataFrame({"seconds": [1.0], "detail": ["signed with late-secret-77"]})
    folder = report.write({"mine": frame}, tmp_path / "run")
    assert "late-secret-77" in (folder / "mine.csv").read_text()
    register("late-secret-77")
    page = report.render(folder).read_text()
    assert "late-secret-77" not in page and "signed with ***" in page
