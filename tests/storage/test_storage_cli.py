"""diag storage as a user runs it: their AWS configuration wins, public buckets, and one line
naming the fix for each mistake (a password in an endpoint URL never shown or stored)."""

from __future__ import annotations

import json
import os
import socket
import urllib.request
import subprocess
import sys
from pathlib import Path

import pytest
from botocore.exceptions import ConnectionClosedError

from diag.cli import main
from diag.config import StorageConfig
from diag.embedded import S3Server
from diag.storage.objectstore import make_client
from tests.s3proxy import Proxy

ROOT = Path(__file__).resolve().parents[2]
URL_PASSWORD = "url-Pa55word-diag-0123"  # only ever in an endpoint URL's userinfo
NO_AWS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None,
          "AWS_PROFILE": None, "AWS_DEFAULT_PROFILE": None, "AWS_ENDPOINT_URL": None,
          "AWS_CONFIG_FILE": "/nonexistent/aws-config",
          "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
          "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.client().put_object(Bucket="diag", Key="data/obj.bin", Body=os.urandom(300_000))
        yield server


@pytest.fixture
def no_aws(monkeypatch):
    """A machine with no AWS credentials or configuration at all."""
    for key, value in NO_AWS.items():
        monkeypatch.delenv(key, raising=False) if value is None else monkeypatch.setenv(key, value)


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def diag_cli(args: list[str], env: dict[str, str | None], cwd: Path) -> tuple[int, str]:
    full = {**os.environ, **{k: v for k, v in env.items() if v is not None}}
    for key in [k for k, v in env.items() if v is None]:
        full.pop(key, None)
    done = subprocess.run([sys.executable, "-m", "diag", "storage", "--quick", *args],
                          capture_output=True, text=True, env=full, cwd=cwd, timeout=120)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
def test_a_password_in_an_endpoint_url_is_never_printed(tmp_path):
    # the one-line connection error names the endpoint: with its userinfo, but never the password
    endpoint = f"http://diaguser:{URL_PASSWORD}@127.0.0.1:{closed_port()}"
    for args, env in [(["--endpoint-url", endpoint], {}),  # the flag
                      ([], {"AWS_ENDPOINT_URL": endpoint})]:  # the variable boto3 reads itself
        code, out = diag_cli(["--source", "s3://diag/data/obj.bin", "--retries", "0", *args],
                             {**NO_AWS, "AWS_ACCESS_KEY_ID": "AKIAFAKEDIAG",
                              "AWS_SECRET_ACCESS_KEY": "fake-secret-diag", **env}, tmp_path)
        assert code == 2 and len(out.strip().splitlines()) == 1, out
        assert "cannot connect" in out and "--endpoint-url / AWS_ENDPOINT_URL" in out
        assert f"diaguser:{URL_PASSWORD}" not in out and URL_PASSWORD not in out
        assert f"@127.0.0.1:{endpoint.rsplit(':', 1)[1]}" in out  # the endpoint is still named


def test_endpoint_url_without_source_is_refused_in_one_line(capsys):
    # the embedded server would be measured instead and the flag silently ignored: refused, and
    # never "used" by uploading a synthetic dataset into the user's store
    for flags in (["--endpoint-url", "http://minio.local:9000"], ["--profile", "prod"],
                  ["--region", "eu-west-1"], ["--no-sign-request"]):
        assert main(["storage", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"ignore {flags[0]}" in err
        assert "--source s3://bucket/key" in err and "StorageConfig.source" in err


def test_public_bucket_needs_no_sign_request_and_works_with_it(s3, tmp_path, no_aws, capsys):
    # a public bucket: anyone may list and read it (moto refuses anonymous requests otherwise;
    # it takes ACLs for HEAD, where a bucket policy covers GET only)
    s3.client().put_bucket_acl(Bucket="diag", ACL="public-read")
    s3.client().put_object_acl(Bucket="diag", Key="data/obj.bin", ACL="public-read")
    args = ["storage", "--quick", "--source", "s3://diag/data/obj.bin", "--endpoint-url",
            s3.endpoint_url, "--repeats", "1", "--warmup", "0", "--local-dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no AWS credentials" in err
    assert "for a public bucket pass --no-sign-request" in err
    assert main([*args, "--no-sign-request"]) == 0  # unsigned: moto, like a
                                                    # public bucket, serves it
    out = capsys.readouterr().out
    assert "boto3_tuned" in out and "land()'s engine" in out


def test_retries_and_region_come_from_the_users_aws_config_unless_given(s3, tmp_path, no_aws,
                                                                        monkeypatch):
    # every response is cut before its first byte: each request botocore makes is one it counts
    config = tmp_path / "aws-config"
    config.write_text("[profile three]\nmax_attempts = 3\nretry_mode = standard\n"
                      "region = eu-central-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    keys = {"aws_access_key_id": s3.access_key, "aws_secret_access_key": s3.secret_key}
    proxy = Proxy(s3.port, cut_after=0, cuts=1000)
    try:
        def requests_made(client) -> int:
            before = len(proxy.requests)
            with pytest.raises(ConnectionClosedError):
                client.head_object(Bucket="diag", Key="data/obj.bin")
            return len(proxy.requests) - before

        assert requests_made(make_client(proxy.url, credentials=keys)) == 2  # AWS_MAX_ATTEMPTS
        monkeypatch.delenv("AWS_MAX_ATTEMPTS")
        monkeypatch.delenv("AWS_DEFAULT_REGION")  # a variable wins over the profile's region
        profiled = make_client(proxy.url, credentials=keys, profile="three")
        assert requests_made(profiled) == 3 and profiled.meta.region_name == "eu-central-1"
        forced = make_client(proxy.url, credentials=keys, profile="three", retries=0,
                             region="ap-south-1")
        assert requests_made(forced) == 1 and forced.meta.region_name == "ap-south-1"
    finally:
        proxy.close()
    with pytest.raises(RuntimeError, match="check --profile / AWS_PROFILE"):
        make_client(profile="no-such-profile")


def test_storage_config_registers_the_url_password_before_anything_runs():
    from diag.secrets import redact

    # URL userinfo is always redacted; the config also registers the password, so it is hidden
    # where it appears alone (a server's error message that echoes it, say)
    text = "auth failed for another-Secret-77 at h:9000"
    assert "another-Secret-77" in redact(text)  # not a secret until the config names it
    StorageConfig(source="s3://b/k", endpoint_url="http://u:another-Secret-77@h:9000")
    assert "another-Secret-77" not in redact(text) and "h:9000" in redact(text)


FAKE_ID, FAKE_SECRET = "AKIAFAKEDIAGTEST0001", "fake/Secret+Key/diag-test-0123456789abcd"
URL_SECRET = "diag-Url-Passw0rd-42"  # reaches the output through the endpoint URL's userinfo


def with_password(endpoint: str, password: str) -> str:
    return endpoint.replace("http://", f"http://diaguser:{password}@")


@pytest.mark.slow
def test_wrong_credentials_name_the_url_never_the_secret(tmp_path):
    # the endpoint (with a password in its userinfo) is in the error line: only redaction keeps
    # the password out, so this fails if redaction is off
    with S3Server() as server:
        server.client().put_object(Bucket="diag", Key="obj", Body=b"x" * 1000)
        # moto checks signatures once auth is switched on: a real rejection, not a mock
        request = urllib.request.Request(f"{server.endpoint_url}/moto-api/reset-auth", data=b"0",
                                         method="POST", headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).read()
        env = {**os.environ, "AWS_ACCESS_KEY_ID": FAKE_ID, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
               "AWS_DEFAULT_REGION": "us-east-1", "DIAG_HOME": str(tmp_path)}
        endpoint = with_password(server.endpoint_url, URL_SECRET)
        done = subprocess.run([sys.executable, "-m", "diag", "storage", "--quick", "--source",
                               "s3://diag/obj", "--endpoint-url", endpoint],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2 and len(out.strip().splitlines()) == 1, out
    assert "access denied" in out and "s3://diag/obj" in out and f"@127.0.0.1:{server.port}" in out
    assert "--profile / AWS_PROFILE" in out and "--no-sign-request" in out
    assert FAKE_SECRET not in out and URL_SECRET not in out and "Traceback" not in out


@pytest.mark.slow
def test_cli_report_with_fake_keys_contains_no_secret(s3, tmp_path):
    # endpoint_url goes into summary.json's config: with a password in it, only redaction keeps
    # it out of the report (and of the tables printed)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": FAKE_ID, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "DIAG_HOME": str(tmp_path / "home")}
    endpoint = with_password(s3.endpoint_url, URL_SECRET)
    done = subprocess.run([sys.executable, "-m", "diag", "storage", "--quick", "--source",
                           "s3://diag/data/obj.bin", "--endpoint-url", endpoint,
                           "--repeats", "1", "--warmup", "0", "--report",
                           "--local-dir", str(tmp_path / "nvme")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "boto3_tuned" in out and "land the dataset once" in out
    assert f"measured into {tmp_path / 'nvme'}, on " in out  # the disk it measured, named
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"storage.csv", "storage_tax.csv", "advice.csv", "storage.png", "report.html",
            "summary.json"} <= names
    summary = next(p for p in files if p.name == "summary.json")
    stored = json.loads(summary.read_text())["config"]["endpoint_url"]
    assert stored.endswith(f"@127.0.0.1:{s3.port}") and URL_SECRET not in stored
    for text in [out] + [p.read_bytes().decode("latin-1") for p in files]:
        assert FAKE_SECRET not in text and FAKE_ID not in text and URL_SECRET not in text
