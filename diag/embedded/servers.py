"""Embedded defaults: an S3-compatible server and a Hugging Face hub endpoint on 127.0.0.1.

Subprocesses in their own process group (`stop()` leaves nothing), speaking the real protocols:
boto3 with an endpoint URL, huggingface_hub with `HF_ENDPOINT` (set it before its import)."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Self

_HOST = "127.0.0.1"
_PKG_PARENT = str(Path(__file__).resolve().parents[2])


def child_env(env: dict[str, str]) -> dict[str, str]:
    """env with this diag importable (first on PYTHONPATH), for `python -m diag...` children."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH"))
                                                 if p)}


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when its parent dies (a SIGKILLed diag leaves no server)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not Linux: the `with` is the only guard
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LoopbackServer:
    """A subprocess serving on 127.0.0.1; a context manager that always kills its process group."""

    start_timeout_s = 30.0

    def __init__(self, port: int | None = None) -> None:
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"port={port!r}: must be an int in 1..65535, or None to pick a "
                             "free one")
        self.host, self._requested_port, self.port = _HOST, port, port or 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, port: int) -> list[str]:
        """The argv that serves on `port` (subclasses define it)."""
        raise NotImplementedError

    def start(self) -> Self:
        if self.proc is not None:
            return self
        # a free port can be taken between our probe and the server's bind: retry a fresh one
        for attempt in range(3):
            try:  # bound and released as the servers bind (SO_REUSEADDR: TIME_WAIT is not "in use")
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind((self.host, self._requested_port or 0))
                    self.port = probe.getsockname()[1]
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                raise RuntimeError(f"port {self._requested_port} on {self.host} is already in "
                                   "use; pass port=None to pick a free one") from None
            try:
                self._spawn()
                break
            except RuntimeError as e:
                if "Address already in use" not in str(e) or self._requested_port or attempt == 2:
                    raise
        return self

    def _spawn(self) -> None:
        # output to a file, not a pipe: a chatty server would block once a pipe buffer fills
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.command(self.port), stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, env=child_env(dict(os.environ)), start_new_session=True,
            preexec_fn=die_with_parent)
        deadline = time.perf_counter() + self.start_timeout_s
        while time.perf_counter() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        why = ("exited during start-up" if self.proc.poll() is not None else
               f"did not accept connections on {self.url} within {self.start_timeout_s:.0f} s")
        self._log.seek(max(0, self._log.seek(0, os.SEEK_END) - 4000))
        tail = self._log.read().decode("utf-8", "replace")
        self.stop()
        raise RuntimeError(f"{type(self).__name__} {why}:\n{tail}")

    def stop(self) -> None:
        """Kill the whole process group (server and anything it spawned) and reap it."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL too: the leader may exit first
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)  # pgid == pid thanks to start_new_session
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5.0)
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class S3Server(LoopbackServer):
    """moto's S3-compatible server; clients are plain boto3 with an endpoint URL."""

    access_key = "diag-local-key"
    secret_key = "diag-local-secret"
    region = "us-east-1"
    endpoint_url = LoopbackServer.url

    def __init__(self, port: int | None = None, bucket: str = "diag") -> None:
        super().__init__(port)
        self.bucket = bucket

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(port)]

    def start(self) -> Self:
        # the server is a subprocess: without this its ImportError would be a log tail
        if missing := [m for m in ("moto", "flask", "flask_cors")
                       if importlib.util.find_spec(m) is None]:
            raise RuntimeError(f"the embedded S3 server needs {', '.join(missing)}: install the "
                               "extra with pip install 'diag[embedded]' (or -e '.[embedded]')")
        if self.proc is None:
            super().start()
            try:
                self.client().create_bucket(Bucket=self.bucket)
            except BaseException:
                self.stop()
                raise
        return self

    def env(self) -> dict[str, str]:
        """Standard AWS variables: the default credential chain and boto3 pick these up."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": self.region}

    def client(self) -> Any:
        """A boto3 S3 client: the same code path a cloud user runs, pointed at loopback."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region)

    def upload(self, path: str | os.PathLike[str], key: str) -> list[str]:
        """Upload a file to `key`, or a folder's files under prefix `key`; return the keys."""
        path, client = Path(path), self.client()
        files = [(path, key)] if path.is_file() else [
            (p, f"{key.rstrip('/')}/{p.relative_to(path).as_posix()}".lstrip("/"))
            for p in sorted(path.rglob("*")) if p.is_file()]
        if not files:
            raise ValueError(f"path={str(path)!r}: no file to upload there")
        for p, k in files:
            client.upload_file(str(p), self.bucket, k)
        return [k for _, k in files]


class HubServer(LoopbackServer):
    """A read-only Hugging Face hub endpoint over `root` (see publish_model for the layout)."""

    endpoint = LoopbackServer.url  # the HF_ENDPOINT value

    def __init__(self, root: str | os.PathLike[str], port: int | None = None) -> None:
        super().__init__(port)
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"root={str(self.root)!r}: not a folder (publish_model creates it)")

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "diag.embedded.hub", str(self.root), self.host, str(port)]

    def env(self) -> dict[str, str]:
        """{"HF_ENDPOINT": ...}: give it to a process before it imports huggingface_hub."""
        return {"HF_ENDPOINT": self.endpoint}
