"""Clean load processes that don't pay the imports per load: `LoadProcesses(env, "fork")` imports
torch, transformers and bitsandbytes once in a zygote (`import_s`), then forks a clean child per
job; `"exec"` runs each job in a fresh interpreter."""

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

from diag.config import MODEL_LOAD_PROCESSES as PROCESSES
from diag.embedded.servers import child_env, die_with_parent
from diag.model_load.worker import crashed, import_libraries, run_job, run_worker

OVERRIDABLE = ("HF_HUB_OFFLINE", "HF_XET_CACHE")


class LoadProcesses:
    """Run load jobs in clean processes, forked from a zygote or exec'd fresh."""

    def __init__(self, env: dict[str, str], process: str = "fork", timeout_s: float = 1800) -> None:
        if process not in PROCESSES:
            raise ValueError(f"process={process!r}: allowed values are 'fork', 'exec'")
        # NVML answers torch.cuda.is_available() without initialising CUDA (a zygote must not)
        self.env = child_env({**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})
        self.process, self.timeout_s = process, timeout_s
        self.import_s: float | None = None  # fork: the zygote's start + imports
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> LoadProcesses:
        if self.process == "fork":
            self._log = tempfile.TemporaryFile()
            spawned = time.perf_counter()  # CLOCK_MONOTONIC: the same in every process
            # its own process group: close() kills it and its children; it dies with this one
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "diag.model_load.processes", repr(spawned)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=self.env,
                text=True, start_new_session=True, preexec_fn=die_with_parent)
            ready = self._reply(self.timeout_s)
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
            return run_worker(job, {**self.env, **overrides}, self.timeout_s)
        assert self._proc is not None, "use LoadProcesses as a context manager"
        self._proc.stdin.write(json.dumps({"job": job, "env": overrides,
                                           "timeout_s": self.timeout_s}) + "\n")
        self._proc.stdin.flush()
        return self._reply(self.timeout_s + 60)  # the zygote enforces timeout_s per child

    def _reply(self, wait_s: float) -> dict[str, Any]:
        assert self._proc is not None and self._log is not None
        if select.select([self._proc.stdout], [], [], wait_s)[0] and (
                line := self._proc.stdout.readline()):
            return json.loads(line)
        self._log.seek(0)
        return crashed(f"zygote exit code {self._proc.poll()}",
                       self._log.read().decode(errors="replace"))


def _child(request: dict[str, Any], import_s: float, out: Any, log: int) -> None:
    """A forked child: the job's result to `out`, its output (a traceback) to `log`."""
    die_with_parent()  # a zygote killed mid-load leaves no orphan
    for fd in (1, 2):
        os.dup2(log, fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # no prompt reads the protocol pipe
    started = time.perf_counter()
    # the environment a fresh interpreter would have had (docs/calibration.md)
    from huggingface_hub import constants

    os.environ.update(request["env"])
    constants.HF_HUB_OFFLINE = constants._is_true(
        os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))
    constants.HF_XET_CACHE = os.environ.get("HF_XET_CACHE", constants.HF_XET_CACHE)
    import_libraries()  # bitsandbytes where the zygote left it out; else free
    out.send({**run_job(request["job"]), "import_s": import_s + time.perf_counter() - started})


def _fork_one(request: dict[str, Any], import_s: float) -> dict[str, Any]:
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    result, out = fork.Pipe(duplex=False)
    with tempfile.TemporaryFile() as log:
        child = fork.Process(target=_child, args=(request, import_s, out, log.fileno()))
        child.start()
        out.close()
        try:
            if not result.poll(request["timeout_s"]):
                child.kill()
                return {"error": "timeout", "type": "timeout", "message": ""}
            return result.recv()
        except EOFError:  # it ended with no result
            child.join()
            log.seek(0)
            return crashed(f"exit code {child.exitcode}", log.read().decode(errors="replace"))
        finally:
            child.join()
            result.close()


def zygote(spawned_at: float) -> int:
    """Import once, check that forking is safe, then fork a child per request line on stdin."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a library's print goes to the log, never into the protocol
    try:
        import numpy  # noqa: F401  its OpenBLAS pool: the one thread allowed
        threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
        baseline = threads()
        import_libraries(with_cuda_libraries=False)
        import_s = time.perf_counter() - spawned_at
        import torch

        # safe to fork: no CUDA, no torch op yet (no OpenMP pool), no HTTP client; OpenBLAS's
        # threads stop and restart around fork (pthread_atfork). Anything more is refused
        if torch.cuda.is_initialized() or threads() != baseline:
            raise RuntimeError(f"unsafe to fork: CUDA initialised={torch.cuda.is_initialized()}, "
                               f"threads {threads()} (numpy alone: {baseline})")
    except (ImportError, RuntimeError) as err:
        _say(protocol, {"error": "zygote", "type": type(err).__name__, "message": str(err)})
        return 1
    _say(protocol, {"import_s": import_s})
    for line in sys.stdin:
        _say(protocol, _fork_one(json.loads(line), import_s))
    return 0


def _say(protocol: IO[str], reply: dict[str, Any]) -> None:
    print(json.dumps(reply), file=protocol, flush=True)


if __name__ == "__main__":
    code = zygote(float(sys.argv[1]))
    sys.stderr.flush()
    # every reply flushed, no child left: skip the teardown close() would wait for
    os._exit(code)
