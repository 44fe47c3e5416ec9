"""A stalled endpoint, as a user meets it: `diag storage` ends within its deadline in one line
naming the endpoint and the object, leaves no scratch folder, and runs once the server answers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diag.embedded import S3Server
from tests.storage.test_storage_cli import NO_AWS

ROOT = Path(__file__).resolve().parents[2]
SLACK_S = 6.0  # past the deadline: botocore's back-off before the refused retry, the exit


@pytest.mark.slow
def test_a_stopped_server_ends_storage_within_its_deadline_and_a_rerun_succeeds(tmp_path):
    land = tmp_path / "land"
    land.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: its scratch folders are orphans
    orphans = [land / f"diag-storage-{dead.pid}", land / f".diag-storage.tmp-{dead.pid}-0123abcd"]
    for folder in orphans:
        (folder / "sample").mkdir(parents=True)
    with S3Server() as s3:
        s3.client().put_object(Bucket=s3.bucket, Key="stall/part-0.bin", Body=os.urandom(8 << 20))
        env = {k: v for k, v in os.environ.items() if k not in NO_AWS}
        env.update({k: v for k, v in NO_AWS.items() if v is not None}, **s3.env(),
                   PYTHONPATH=str(ROOT))
        argv = [sys.executable, "-m", "diag", "storage", "--source", f"s3://{s3.bucket}/stall/",
                "--endpoint-url", s3.endpoint_url, "--local-dir", str(land), "--stall-s", "2",
                "--repeats", "3"]  # retries: the user's configuration (5 attempts here)
        run = subprocess.Popen(argv, env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        while not any(land.glob(".diag-storage.tmp-*/sample/*")):  # the probe has begun
            assert run.poll() is None, run.communicate()
            time.sleep(0.02)
        os.kill(s3.pid, signal.SIGSTOP)
        stopped = time.perf_counter()
        try:
            _, err = run.communicate(timeout=120)
        finally:
            os.kill(s3.pid, signal.SIGCONT)
        took = time.perf_counter() - stopped
        lines = [line for line in err.splitlines() if line.strip()]
        assert run.returncode != 0 and len(lines) == 1, err
        assert s3.endpoint_url in lines[0] and "s3://diag/stall/" in lines[0], lines[0]
        limit = float(re.search(r"(?:deadline of |--stall-s=)([\d.]+) s", lines[0])[1])
        assert took <= limit + SLACK_S, (took, lines[0])
        assert list(land.iterdir()) == []  # its own scratch gone, the dead pids' swept
        again = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                               timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "boto3_default" in again.stdout and list(land.iterdir()) == []
