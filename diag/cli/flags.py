"""The command line's flags, generated from the config dataclasses: one `--flag` per field, its
help the field's trailing comment, a `Literal` its choices, a list a comma-separated value."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import types
import typing
from typing import Any

from diag.config import SourceConfig


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
                f"{text!r} is not a comma-separated list of {item.__name__}") from None
        if wrong := [v for v in values if choices and v not in choices]:
            raise argparse.ArgumentTypeError(f"{wrong[0]!r} is not one of "
                                             + ", ".join(map(str, choices)))
        return values

    parse.__name__ = f"list of {item.__name__}"
    return parse


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Each field's trailing comment (and deeper-indented comment lines below), from source."""
    import inspect

    docs: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for klass in reversed(cls.__mro__):  # a subclass's comment wins over its base's
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):  # no source (a frozen app, a class made at run time)
            continue
        name, indent = "", 0
        for line in lines:
            field = re.match(r"( *)(\w+): [^#]*#(.*)", line)  # no default holds a "#"
            more = re.match(r"( *)#(.*)", line)
            if field and field[2] in names:
                name, indent, docs[field[2]] = field[2], len(field[1]), field[3].strip()
            elif name and more and len(more[1]) > indent:  # a comment-only line indented deeper
                docs[name] = f"{docs[name]} {more[2].strip()}".strip()
            else:
                name = ""
    return docs


def unrecognized(name: str, config: type, extra: list[str]) -> UsageError:
    """The line for arguments the command does not take (a source flag: which ones it reads)."""
    text = f"python -m diag {name}: unrecognized arguments: {' '.join(extra)}"
    source = getattr(config, "SOURCE", ())
    given = {a.split("=", 1)[0].removeprefix("--no-").removeprefix("--").replace("-", "_")
             for a in extra if a.startswith("--")}
    if source and given & {f.name for f in dataclasses.fields(config)}:  # a source flag
        flags = ", ".join("--" + f.replace("_", "-") for f in source)
        return UsageError(f"{text} ({name} reads only these source flags: {flags})")
    return UsageError(f"{text} (see python -m diag {name} --help)")


def build_parser(experiments: dict[str, Any], description: str, only: str | None = None) -> _Parser:
    """One sub-command per experiment, a flag per config field (only: that one's flags alone)."""
    from diag import __version__

    parser = _Parser(prog="python -m diag", description=description)
    parser.add_argument("--version", action="version",
                        version=f"diag {__version__} (python {sys.version.split()[0]})")
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", parser_class=_Parser)
    for name, exp in experiments.items():
        # the config's docstring, less its "`diag name`: " lead
        about = " ".join((exp.config.__doc__ or "").split()).split("`: ", 1)[-1].rstrip(".")
        presets = "".join(f"; preset {k}{' (--quick)' if k == 'QUICK' else ''}: "  # QUICK: --quick
                          + ", ".join(f"{f}={v}" for f, v in preset.items())
                          for k, preset in vars(exp.config).items()
                          if k.isupper() and isinstance(preset, dict) and preset)
        p = sub.add_parser(name, help=about, description=about + presets.replace("%", "%%"))
        p.add_argument("--quick", action="store_true",
                       help="the test-sized variant (also DIAG_QUICK=1)")
        if exp.table:  # the others write a run folder with every table instead
            p.add_argument("--csv", metavar="FILE", help="also write the main result table to FILE")
            p.add_argument("--json", action="store_true",
                           help="print the result tables as JSON (for scripts) instead of text")
            p.add_argument("--report", action="store_true",
                           help="also write a run folder (CSVs, figures, report.html) under runs/")
        if only not in (None, name):
            continue
        hints = typing.get_type_hints(exp.config)
        docs = field_docs(exp.config)
        positional = getattr(exp.config, "POSITIONAL", ())
        # a source field it does not read (not in its SOURCE): no flag
        every = SourceConfig.SOURCE
        unread = set(every) - set(getattr(exp.config, "SOURCE", every))
        for f in [f for f in dataclasses.fields(exp.config) if f.name not in unread]:
            kwargs = _flag_type(hints[f.name])
            doc = docs.get(f.name, "")
            if f.name in positional:
                if typing.get_origin(hints[f.name]) in (list, tuple):  # FILE [FILE ...]
                    kwargs = {"nargs": "+"}
                kwargs["metavar"] = f.name.removesuffix("s").upper()  # PID, FILE, FOLDER
                p.add_argument(f.name, help=doc.replace("%", "%%"), **kwargs)
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            text = f"{doc} (default: {shown!r})" if doc else f"default: {shown!r}"
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS,
                           help=text.replace("%", "%%"), **kwargs)  # argparse %-formats help
    return parser
