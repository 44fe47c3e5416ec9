"""`python -m diag <experiment> [--key value ...]`: the notebooks' runs, without a notebook.

Flags come from each experiment's config dataclass (`--quick`: the test-sized variant); results
print as tables (`--json`), `--csv FILE` writes the main one, `--report` a run folder. A user error
prints one line and exits 2 (DIAG_DEBUG=1: the traceback); a run ends without the interpreter's
teardown, under torchrun once this node's other ranks have said theirs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import threading
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag import config
from diag.cli.flags import UsageError, build_parser, unrecognized
from diag.secrets import redact, redact_frame
from diag.timing import distributed


@dataclass(frozen=True)
class Experiment:
    config: type[config.ExperimentConfig]  # its docstring is the command's help
    runner: str  # "module:function", imported only when the experiment runs
    table: bool = True  # returns tables (--csv, --json, --report); False: returns a run folder
    ddp: bool = False  # runs as one DDP rank under torchrun / accelerate launch


EXPERIMENTS: dict[str, Experiment] = {
    "info": Experiment(config.InfoConfig, "diag.machine.device:run_info"),
    "toy": Experiment(config.ToyConfig, "diag.loader.toy:run_toy", ddp=True),
    "storage": Experiment(config.StorageConfig, "diag.storage:run_storage"),
    "model-load": Experiment(config.ModelLoadConfig, "diag.model_load:run_model_load"),
    "loader": Experiment(config.LoaderConfig, "diag.loader:run_loader"),
    "accum": Experiment(config.AccumConfig, "diag.accum:run_accum", ddp=True),
    "qlora": Experiment(config.QLoraConfig, "diag.qlora:run_qlora", ddp=True),
    "train": Experiment(config.TrainConfig, "diag.qlora:run_train"),
    "attach": Experiment(config.AttachConfig, "diag.observe:run_attach"),
    "trace": Experiment(config.TraceConfig, "diag.observe:run_trace"),
    "run": Experiment(config.DiagnoseConfig, "diag.diagnose:run_diagnose", table=False),
    "report": Experiment(config.ReportConfig, "diag.report:run_report", table=False),
}


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every experiment's sub-command, its flags made from its config (only: that command's)."""
    return build_parser(EXPERIMENTS, __doc__.split("\n")[0], only)


def parse(argv: list[str]) -> tuple[str, config.ExperimentConfig, argparse.Namespace]:
    # the named command's flags only: reading every config's comments costs a third of a second
    named = next((a for a in argv[:1] if a in EXPERIMENTS), None)
    args, extra = parser(named).parse_known_args(argv)
    if not args.experiment:
        raise UsageError("python -m diag: name an experiment: " + ", ".join(EXPERIMENTS))
    exp = EXPERIMENTS[args.experiment]
    if extra:
        raise unrecognized(args.experiment, exp.config, extra)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(exp.config)
                 if hasattr(args, f.name)}
    return args.experiment, exp.config.default(quick=args.quick or None, **overrides), args


def run(name: str, cfg: config.ExperimentConfig) -> Any:
    module, function = EXPERIMENTS[name].runner.split(":")
    runner = getattr(importlib.import_module(module), function)
    if not isinstance(cfg, config.SourceConfig) or isinstance(cfg, config.TrainConfig):
        return runner(cfg)  # diag train's preflight follows its --out-dir's check
    from diag.preflight import covered, preflight

    # the QLoRA job that trains on cfg's source: its records are checked before the work
    job = cfg if isinstance(cfg, config.QLoraConfig) else None
    if isinstance(cfg, config.DiagnoseConfig):  # a budget too small for its steps: refused first
        from diag.diagnose import job_config, steps
        from diag.forecast.budget import of_run

        job = job_config(cfg) if cfg.qlora else None
        of_run(cfg, steps(cfg), job)
    # every check that can run before the first experiment, once, before torch is imported
    if job is not None and job.results:  # another job's: refused before anything is written
        from diag.qlora.measure import read_results

        read_results(job)
    preflight(cfg, job)
    with covered():
        return runner(cfg)


def join(name: str, cfg: config.ExperimentConfig) -> None:
    """Under a launcher: refuse a one-process command, else join the group; same args on all."""
    if not EXPERIMENTS[name].ddp:
        raise UsageError(
            f"diag: `diag {name}` runs in one process, not under a launcher (WORLD_SIZE="
            f"{distributed.place().world_size}): run it alone on one GPU, then launch the job "
            "itself, e.g. `torchrun --nproc_per_node N -m diag qlora --report` "
            "(also toy, accum; docs/distributed.md)")
    from diag.machine.device import resolve

    distributed.init_group(resolve(getattr(cfg, "device", "cpu")).type)
    distributed.agree(cfg)


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C: every `with` block exits (servers stop, partials go)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        name, cfg, args = parse(sys.argv[1:] if argv is None else argv)
        if distributed.launched():
            join(name, cfg)
        result = run(name, cfg)
    except (UsageError, ValueError, RuntimeError, OSError, ImportError,
            subprocess.TimeoutExpired) as err:
        own_module = isinstance(err, ModuleNotFoundError) and (err.name or "").startswith("diag")
        if os.environ.get("DIAG_DEBUG") or own_module:  # a broken diag install is a bug, not usage
            raise
        line = one_line(distributed.ending(err)).replace("diag: ", f"diag: {distributed.who()}", 1)
        sys.stderr.write(redact(line) + "\n")  # one write: the ranks share the launcher's stderr
        said()
        return 2  # (a run stopped before its end says where its spilled steps are, at exit)
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM: a run that saved a checkpoint says how
        sys.stderr.write(redact(str(err) or "diag: interrupted") + "\n")
        return 128 + getattr(err, "signum", signal.SIGINT)
    if not distributed.who() or distributed.place().is_root:  # rank 0 alone prints and writes
        show(name, cfg, result, args)
    return 0


def entry() -> typing.NoReturn:
    """`python -m diag` and the `diag` script: main(), then an exit without teardown."""
    exit_now(main())


def one_line(err: BaseException) -> str:
    if isinstance(err, UsageError):
        return str(err)
    if isinstance(err, ModuleNotFoundError):
        return (f"diag: this experiment needs the package {err.name!r}, which is not installed; "
                "install the extras with: pip install -e '.[all]' (or run `make demo`)")
    text = " ".join(str(err).split()) or type(err).__name__
    if type(err) is ValueError:  # diag's refusal of a setting: "diag: --flag=value: why; fix"
        return f"diag: {text}"
    return f"diag: {type(err).__name__}: {text}"


def show(name: str, cfg: config.ExperimentConfig, result: Any, args: argparse.Namespace) -> None:
    import json

    import pandas as pd

    from diag import report
    from diag.frames import frames_of

    if isinstance(result, Path):  # a run folder: where it is and what it found
        from diag.machine.contention import busy

        summary = report.load_summary(result)
        head, said = summary.get("headline"), busy(summary.get("machine") or {})
        print(redact(f"wrote {result / 'report.html'}\n"
                     + (head["text"] if head else "nothing measured stands out")
                     + (f"\n{said[0].upper() + said[1:]}" if said else "")))
        return
    frames = frames_of(name, result)
    if getattr(args, "csv", None):
        redact_frame(next(iter(frames.values()))).to_csv(args.csv, index=False)
    if getattr(args, "json", False):
        print(redact(json.dumps({k: json.loads(f.to_json(orient="records"))
                                 for k, f in frames.items()}, indent=1)))
    else:
        with pd.option_context("display.max_rows", 200, "display.width", 160,
                               "display.max_colwidth", 80):
            for key, frame in frames.items():
                if key == "advice":
                    lines = [f"{a.finding}: saves {a.seconds_saved:.3g} s per start ({a.evidence})"
                             for a in frame.itertuples()]
                    print(redact("\n".join(["", "advice:", *lines])) if lines else "")
                    continue
                heading = f"\n{key}:\n" if len(frames) > 1 else ""
                print(redact(heading + frame.to_string(index=False,
                                                       float_format=lambda v: f"{v:.4g}")))
    if getattr(args, "report", False):
        folder = report.write(frames, config=cfg.to_dict(), advice=frames.pop("advice", None))
        print(redact(f"wrote {folder / 'report.html'}"),
              file=sys.stderr if args.json else sys.stdout)


def exit_now(code: int) -> typing.NoReturn:
    """Exit without the interpreter's teardown of torch (seconds), doing what an exit still does."""
    import atexit
    import ctypes

    distributed.hold_sigterm()  # the code is chosen: no SIGTERM may raise in an atexit handler
    threading._shutdown()  # type: ignore[attr-defined]  # Py_Finalize's order: threads, atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing can reach it
            stream.flush()
    ctypes.CDLL(None).fflush(None)  # a C library's printf buffer
    os._exit(code)


def said() -> None:
    """Under torchrun, wait (timeout_s("say")) till the node's other ranks said theirs or ended."""
    import tempfile
    import time

    import psutil

    from diag.files import temp_path

    if distributed.spilled() is not None or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    try:
        others = [p for p in psutil.Process(os.getppid()).children() if p.pid != os.getpid()]
    except psutil.Error:  # no parent left to ask
        return
    base = Path(tempfile.gettempdir()) / f"diag-said-{os.getppid()}"
    mark = temp_path(base)  # its name carries this pid: swept by a later start if left behind
    mark.touch()
    deadline = time.monotonic() + distributed.timeout_s("say")
    try:
        while others and time.monotonic() < deadline:
            time.sleep(0.1)
            others = [p for p in others if distributed.alive(p.pid) and not any(
                base.parent.glob(f".{base.name}.tmp-{p.pid}-*"))]
    finally:
        mark.unlink(missing_ok=True)
