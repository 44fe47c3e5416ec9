"""Clean load processes that don't pay the imports per load: `LoadProcesses(env, "fork")` starts a
zygote (diag.model_load.worker) that imports torch, transformers and bitsandbytes once
(`import_s`), then forks a clean child per job; `"exec"` runs each job in a fresh interpreter."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

from diag.embedded.servers import child_env, die_with_parent
from diag.model_load.worker import crashed

OVERRIDABLE = ("HF_HUB_OFFLINE", "HF_XET_CACHE")


class LoadProcesses:
    """Run load jobs in clean processes, forked from a zygote or exec'd fresh."""

    def __init__(self, env: dict[str, str], process: str = "fork", timeout_s: float = 1800) -> None:
        # NVML answers torch.cuda.is_available() without initialising CUDA (a zygote must not)
        self.env = child_env({**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})
        self.process, self.timeout_s = process, timeout_s
        self.import_s: float | None = None  # fork: the zygote's start + imports
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> LoadProcesses:
        if self.process == "fork":
            ready = self._start({"mode": "zygote"}, self.env)
            if "error" in ready:
                self.close()
                raise RuntimeError(f"the model-load zygote could not start ({ready['type']}): "
                                   f"{ready['message']}; --process exec runs each load in a "
                                   "fresh interpreter instead")
            self.import_s = ready["import_s"]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()  # EOF: the zygote exits
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a load child still running dies with it
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            self._proc.stdout.close()
        if self._log is not None:
            self._log.close()
        self._proc = self._log = None

    def run(self, job: dict[str, Any], overrides: dict[str, str] | None = None) -> dict[str, Any]:
        """One job's result dict (it may hold "error"), with `import_s`."""
        overrides = overrides or {}
        assert set(overrides) <= set(OVERRIDABLE), f"cannot vary {set(overrides)} per job"
        if self.process == "exec":
            try:
                return self._start(job, {**self.env, **overrides})
            finally:
                self.close()
        assert self._proc is not None, "use LoadProcesses as a context manager"
        self._proc.stdin.write(json.dumps({"job": job, "env": overrides,
                                           "timeout_s": self.timeout_s}) + "\n")
        self._proc.stdin.flush()
        return self._reply(self.timeout_s + 60)  # the zygote enforces timeout_s per child

    def _start(self, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        """A worker process for `job` (or the zygote) and its first reply."""
        job, self._log = {**job, "spawned_at": time.perf_counter()}, tempfile.TemporaryFile()
        # its own process group: close() kills it and its children; it dies with this one
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "diag.model_load.worker", json.dumps(job)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=env, text=True, start_new_session=True, preexec_fn=die_with_parent)
        return self._reply(self.timeout_s)

    def _reply(self, wait_s: float) -> dict[str, Any]:
        assert self._proc is not None and self._log is not None
        ready = select.select([self._proc.stdout], [], [], wait_s)[0]
        if ready and (line := self._proc.stdout.readline()):
            return json.loads(line)
        if not ready:  # out of time: it and any child it forked are killed
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
            return {"error": "timeout", "type": "timeout", "message": ""}
        self._log.seek(0)  # its output ended with no reply: it is exiting
        who = "zygote " if self.process == "fork" else ""
        return crashed(f"{who}exit code {self._proc.wait()}",
                       self._log.read().decode(errors="replace"))
