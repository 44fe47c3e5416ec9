"""`python -m diag <experiment> [--key value ...]`: the notebooks' runs, without a notebook.

Flags come from each experiment's config dataclass (`--quick`: the test-sized variant); results
print as tables (`--json`), `--csv FILE` writes the main one, `--report` a run folder. A user error
prints one line and exits 2 (DIAG_DEBUG=1: the traceback)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import threading
import typing
from dataclasses import dataclass
from typing import Any

from diag import config
from diag.cli.flags import UsageError, build_parser, unrecognized
from diag.cli.shutdown import exit_now, said
from diag.cli.show import one_line, show
from diag.secrets import redact


@dataclass(frozen=True)
class Experiment:
    config: type[config.ExperimentConfig]
    runner: str  # "module:function", imported only when the experiment runs
    help: str
    table: bool = True  # returns tables (--csv, --json, --report); False: returns a run folder
    ddp: bool = False  # runs as one DDP rank under torchrun / accelerate launch


EXPERIMENTS: dict[str, Experiment] = {
    "info": Experiment(config.InfoConfig, "diag.machine.device:run_info",
                       "what this machine is: accelerator, dense peak FLOP/s, CPU, RAM, disks"),
    "toy": Experiment(config.ToyConfig, "diag.loader.toy:run_toy",
                      "a timed toy training loop: data_wait, h2d and compute per step", ddp=True),
    "storage": Experiment(config.StorageConfig, "diag.storage:run_storage",
                          "object-store pull vs local disk read, the re-pull tax, land() miss/hit"),
    "model-load": Experiment(config.ModelLoadConfig, "diag.model_load:run_model_load",
                             "fresh vs cached model load: download, read, quantize, to_device, "
                             "tokenizer"),
    "loader": Experiment(config.LoaderConfig, "diag.loader:run_loader",
                         "DataLoader num_workers sweep against a training step, fetch vs prep "
                         "stalls, the hot lines of the naive preprocessing"),
    "accum": Experiment(config.AccumConfig, "diag.accum:run_accum",
                        "grad accumulation at constant tokens per step: tokens/s, memory, "
                        "MFU (cross-checked), the floor", ddp=True),
    "qlora": Experiment(config.QLoraConfig, "diag.qlora:run_qlora",
                        "the QLoRA fine-tune (nf4 + LoRA, Trainer), naive vs optimized plan: "
                        "stages, loss curves, predicted vs measured saving per fix", ddp=True),
    "train": Experiment(config.TrainConfig, "diag.qlora:run_train",
                        "the QLoRA fine-tune of the whole dataset under the optimized (or naive) "
                        "plan: epochs, held-out eval, checkpoints and resume, an ETA checked "
                        "after; the adapter (PEFT's format) and tokenizer in --out-dir"),
    "attach": Experiment(config.AttachConfig, "diag.observe:run_attach",
                         "sample a running training process (py-spy, NVML, /proc; never paused "
                         "or signalled): its stages, its workers' hot functions, its GPUs"),
    "trace": Experiment(config.TraceConfig, "diag.observe:run_trace",
                        "read torch.profiler traces (Kineto .json or .json.gz, one per rank): "
                        "stages per rank, GPU idle time, stragglers"),
    "run": Experiment(config.DiagnoseConfig, "diag.diagnose:run_diagnose",
                      "the whole diagnosis on one source: every experiment, then the report",
                      table=False),
    "report": Experiment(config.ReportConfig, "diag.report:run_report",
                         "re-render a run folder's figures and report.html from its CSVs",
                         table=False),
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

    job = _job(cfg)
    if isinstance(cfg, config.DiagnoseConfig):  # a budget too small for its steps: refused first
        from diag.forecast.budget import of_run
        from diag.diagnose import steps

        of_run(cfg, steps(cfg), job)
    # every check that can run before the first experiment, once, before torch is imported
    if job is not None and job.results:  # another job's: refused before anything is written
        from diag.qlora.measure import read_results

        read_results(job)
    preflight(cfg, job)
    with covered():
        return runner(cfg)


def _job(cfg: config.SourceConfig) -> config.QLoraConfig | None:
    """The QLoRA job that trains on cfg's source (its records are checked before the work)."""
    if isinstance(cfg, config.QLoraConfig):
        return cfg
    if isinstance(cfg, config.DiagnoseConfig) and cfg.qlora:
        from diag.diagnose import job_config

        return job_config(cfg)
    return None


def join(name: str, cfg: config.ExperimentConfig) -> None:
    """Under a launcher: refuse a one-process command, else join the group; same args on all."""
    from diag.timing import distributed

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
    from diag.timing import distributed

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
