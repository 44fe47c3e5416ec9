"""diag.secrets: every route a credential takes into text is redacted, and nothing else is."""

from __future__ import annotations

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
