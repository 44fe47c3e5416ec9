"""`python -m diag <experiment> [--key value ...]`: the notebooks' runs, without a notebook.

Each experiment's flags are generated from its config dataclass, so the CLI and the notebooks
share one set of names and defaults; `--quick` takes the test-sized variant. Runners return data
(a DataFrame, or a dataclass of frames) and this module alone shows it, the same way for every
experiment: the tables are printed (`--json` prints them as JSON instead), `--csv FILE` writes the
main table, `--report` writes a run folder with the report. User errors (unknown flag, bad value,
missing package or hardware) print one line and exit 2; set DIAG_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

from diag import config
from diag.secrets import redact, redact_frame
from diag.shutdown import exit_now


@dataclass(frozen=True)
class Experiment:
    config: type[config.ExperimentConfig]
    runner: str  # "module:function", imported only when the experiment runs
    help: str
    table: bool = True  # returns tables (--csv, --json, --report); False: returns a run folder


EXPERIMENTS: dict[str, Experiment] = {
    "info": Experiment(config.InfoConfig, "diag.device:run_info",
                       "what this machine is: accelerator, dense peak FLOP/s, CPU, RAM, disks"),
    "toy": Experiment(config.ToyConfig, "diag.toy:run_toy",
                      "a timed toy training loop: data_wait, h2d and compute per step"),
    # -- storage --
    "storage": Experiment(config.StorageConfig, "diag.storage:run_storage",
                          "object-store pull vs local NVMe read, the re-pull tax, land() miss/hit"),
    # -- model-load --
    "model-load": Experiment(config.ModelLoadConfig, "diag.model_load:run_model_load",
                             "fresh vs cached model load: download, read, quantize, to_device, "
                             "tokenizer"),
    # -- loader --
    "loader": Experiment(config.LoaderConfig, "diag.loader:run_loader",
                         "DataLoader num_workers sweep against a training step, fetch vs prep "
                         "stalls, the hot lines of the naive preprocessing"),
    # -- accum --
    "accum": Experiment(config.AccumConfig, "diag.accum:run_accum",
                        "grad accumulation at constant tokens per step: tokens/s, memory, "
                        "MFU (cross-checked), the floor"),
    # -- qlora --
    "qlora": Experiment(config.QLoraConfig, "diag.qlora:run_qlora",
                        "the QLoRA fine-tune (nf4 + LoRA, Trainer), naive vs optimized plan: "
                        "stages, loss curves, predicted vs measured saving per fix"),
    "run": Experiment(config.DiagnoseConfig, "diag.diagnose:run_diagnose",
                      "the whole diagnosis on one source: every experiment, then the report",
                      table=False),
    "report": Experiment(config.ReportConfig, "diag.report:run_report",
                         "re-render a run folder's figures and report.html from its CSVs",
                         table=False),
}


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # argparse's default prints usage + 2 lines
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _flag_type(hint: Any) -> dict[str, Any]:
    """argparse kwargs for one dataclass field type; a Literal gives the flag its choices."""
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if origin is typing.Literal:
        return {"type": type(args[0]), "choices": args, "metavar": "{" + ",".join(args) + "}"}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin in (list, tuple):
        item = args[0] if args else str
        choices = typing.get_args(item) if typing.get_origin(item) is typing.Literal else ()
        name = "{" + ",".join(choices) + "}" if choices else item.__name__.upper()
        return {"type": _list_of(type(choices[0]) if choices else item, choices),
                "metavar": f"{name},..."}
    if hint in (int, float, str):
        return {"type": hint, "metavar": hint.__name__.upper()}
    return {"type": str, "metavar": "VALUE"}


def _list_of(item: type, choices: tuple[Any, ...] = ()) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            values = [item(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of {item.__name__}"
            ) from None
        wrong = [v for v in values if choices and v not in choices]
        if wrong:
            raise argparse.ArgumentTypeError(f"{wrong[0]!r} is not one of "
                                             + ", ".join(map(str, choices)))
        return values

    parse.__name__ = f"list of {item.__name__}"
    return parse


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's trailing comment: the config's one-line docs, read from source.

    Comments, not field(metadata=...): the configs stay one readable line per field (literal
    default, then why), and the help can never drift from the comment a reader sees. A comment
    too long for one line goes on in comment-only lines right below the field, indented deeper
    than the field; they are joined with single spaces.
    """
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    docs: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for klass in reversed(cls.__mro__):  # a subclass's comment wins over its base's
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (a frozen app, a class made at run time)
            continue
        lines = source.splitlines()
        comments = {t.start[0]: t.string.lstrip("#").strip()
                    for t in tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type == tokenize.COMMENT}
        for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id in names:
                end = node.end_lineno or node.lineno
                text = comments.get(end) or comments.get(node.lineno)
                if not text:
                    continue
                parts = [text]
                # continuation lines: comment only, indented deeper than the field
                for number in range(end + 1, len(lines) + 1):
                    line = lines[number - 1]
                    indent = len(line) - len(line.lstrip())
                    if not line.lstrip().startswith("#") or indent <= node.col_offset:
                        break
                    parts.append(comments[number])
                docs[node.target.id] = " ".join(p for p in parts if p)
    return docs


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import diag

    try:
        installed = version("diag")
    except PackageNotFoundError:
        installed = diag.__version__
    return f"diag {installed} (python {sys.version.split()[0]})"


def _presets(cls: type) -> str:
    """The sweep presets a config defines (QUICK is --quick; GPU, CPU, RUN: what `diag run`
    applies), shown in --help so what runs is visible before it runs."""
    found = {k: v for k, v in vars(cls).items() if k.isupper() and isinstance(v, dict) and v}
    return "".join(f"; preset {k}{' (--quick)' if k == 'QUICK' else ''}: "
                   + ", ".join(f"{f}={v}" for f, v in preset.items())
                   for k, preset in found.items()).replace("%", "%%")


def build_parser() -> _Parser:
    parser = _Parser(prog="python -m diag", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", parser_class=_Parser)
    for name, exp in EXPERIMENTS.items():
        p = sub.add_parser(name, help=exp.help, description=exp.help + _presets(exp.config))
        p.add_argument("--quick", action="store_true",
                       help="the test-sized variant (also DIAG_QUICK=1)")
        if exp.table:  # the others write a run folder with every table instead
            p.add_argument("--csv", metavar="FILE", help="also write the main result table to FILE")
            p.add_argument("--json", action="store_true",
                           help="print the result tables as JSON (for scripts) instead of text")
            p.add_argument("--report", action="store_true",
                           help="also write a run folder (CSVs, figures, report.html) under runs/")
        hints = typing.get_type_hints(exp.config)
        docs = field_docs(exp.config)
        positional = getattr(exp.config, "POSITIONAL", ())
        for f in dataclasses.fields(exp.config):
            kwargs = _flag_type(hints[f.name])
            doc = docs.get(f.name, "")
            if f.name in positional:
                p.add_argument(f.name, help=doc.replace("%", "%%"), **kwargs)
                continue
            default = _default(f)
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            text = f"{doc} (default: {shown!r})" if doc else f"default: {shown!r}"
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS,
                           help=text.replace("%", "%%"), **kwargs)  # argparse %-formats help
    return parser


ALIASES = {"workers": "loader"}  # old command -> its name now; kept one release, with a warning


def parse(argv: list[str]) -> tuple[str, config.ExperimentConfig, argparse.Namespace]:
    parser = build_parser()
    if argv and argv[0] in ALIASES:
        print(f"diag: `{argv[0]}` is now `{ALIASES[argv[0]]}`; the old name goes in the next "
              "release", file=sys.stderr)
        argv = [ALIASES[argv[0]], *argv[1:]]
    args = parser.parse_args(argv)
    if not args.experiment:
        raise UsageError("python -m diag: name an experiment: " + ", ".join(EXPERIMENTS))
    exp = EXPERIMENTS[args.experiment]
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(exp.config)
                 if hasattr(args, f.name)}
    cfg = exp.config.default(quick=True if args.quick else None, **overrides)
    return args.experiment, cfg, args


def run(name: str, cfg: config.ExperimentConfig) -> Any:
    module, function = EXPERIMENTS[name].runner.split(":")
    return getattr(importlib.import_module(module), function)(cfg)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if threading_main():
        # SIGTERM (a timeout, a scheduler, `kill`) unwinds like Ctrl-C, so every `with` block
        # runs its exit: local servers stop, partial files are removed
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        name, cfg, args = parse(argv)
        result = run(name, cfg)
    except (UsageError, ValueError, RuntimeError, OSError, ImportError,
            subprocess.TimeoutExpired) as err:
        own_module = isinstance(err, ModuleNotFoundError) and (err.name or "").startswith("diag")
        if os.environ.get("DIAG_DEBUG") or own_module:  # a broken diag install is a bug, not usage
            raise
        if _this_rank_speaks(err):  # under a launcher: once, not one copy per rank
            print(redact(_one_line(err)), file=sys.stderr)
        return 2
    if _this_rank_speaks(None):  # only rank 0 prints and writes the run folder
        _show(name, cfg, result, args)
    return 0


def _this_rank_speaks(err: BaseException | None) -> bool:
    from diag.distributed import speaks

    return speaks(err)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _one_line(err: BaseException) -> str:
    if isinstance(err, UsageError):
        return str(err)
    if isinstance(err, ModuleNotFoundError):
        return (f"diag: this experiment needs the package {err.name!r}, which is not installed; "
                "install the extras with: pip install -e '.[all]' (or run `make demo`)")
    text = " ".join(str(err).split()) or type(err).__name__
    return f"diag: {type(err).__name__}: {text}"


def frames_of(name: str, result: Any) -> dict[str, Any]:
    """A runner's result as named frames: a DataFrame is the experiment's table; a dataclass of
    frames gives its first field that name and the others `<name>_<field>` (`advice` kept as is)."""
    import pandas as pd

    from diag.decision import Decision, frame
    from diag.timing import STAGE_FRAME, is_stage_frame

    key = name.replace("-", "_")
    if isinstance(result, pd.DataFrame):
        result = types.SimpleNamespace(frame=result)
    elif not dataclasses.is_dataclass(result):
        raise TypeError(f"{name}: a runner returns a DataFrame or a dataclass of frames, "
                        f"not {type(result).__name__}")
    out = {}
    for i, (field, value) in enumerate(vars(result).items() if isinstance(
            result, types.SimpleNamespace) else ((f.name, getattr(result, f.name))
                                                 for f in dataclasses.fields(result))):
        if isinstance(value, tuple) and value and all(isinstance(d, Decision) for d in value):
            out["decisions"] = frame(value)  # one key whichever experiment decided
        elif isinstance(value, pd.DataFrame) and is_stage_frame(value):
            # the stage frame under one key, whichever command wrote it: the report's shares,
            # findings and Amdahl curve read it there (`run` names the run, e.g. `toy`)
            out[STAGE_FRAME] = value if "run" in value.columns else value.assign(run=key)
        elif isinstance(value, pd.DataFrame):
            out[key if i == 0 else field if field == "advice" else f"{key}_{field}"] = value
    return out


def _show(name: str, cfg: config.ExperimentConfig, result: Any, args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    import pandas as pd

    if isinstance(result, Path):  # a run folder: where it is and what it found
        from diag import report

        summary = report.load_summary(result)
        top = summary.get("top_finding") or "nothing measured stands out"
        print(redact(f"wrote {result / 'report.html'}\ntop finding: {top}"))
        head = summary.get("headline") or report.headline(summary.get("stages") or [])
        if head:
            print(head["text"])
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
                    print("\n".join(["", "advice:", *lines]) if lines else "")
                    continue
                heading = f"\n{key}:\n" if len(frames) > 1 else ""
                print(redact(heading + frame.to_string(index=False,
                                                       float_format=lambda v: f"{v:.4g}")))
    if getattr(args, "report", False):
        from diag import report

        advice = frames.pop("advice", None)
        folder = report.write(frames, config=cfg.to_dict(), advice=advice)
        print(redact(f"wrote {folder / 'report.html'}"),
              file=sys.stderr if args.json else sys.stdout)


if __name__ == "__main__":
    exit_now(main())
