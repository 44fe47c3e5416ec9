"""The base every experiment config builds on (validation, `quick()`, `default()`; DIAG_QUICK is
read here only), the names every layer shares, and `diag_home()`: where diag keeps files."""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args

T = TypeVar("T", bound="ExperimentConfig")

# names every layer shares, defined once (the CLI offers them as choices)
Scenario = Literal["fresh", "cached", "cached_offline", "cached_cold"]
MODEL_LOAD_SCENARIOS: tuple[str, ...] = get_args(Scenario)
LoadProcess = Literal["fork", "exec"]
STORAGE_PULLS = ("boto3_default", "boto3_tuned", "s5cmd")
Verify = Literal["sha256", "size"]
VERIFY_MODES: tuple[str, ...] = get_args(Verify)
ON_ERROR = ("raise", "skip")  # a malformed row: stop, or leave it out and list it


def quick_mode() -> bool:
    """True when DIAG_QUICK is set to anything but '', '0', 'false' or 'no'."""
    return os.environ.get("DIAG_QUICK", "").strip().lower() not in ("", "0", "false", "no")


def diag_home() -> Path:
    """$DIAG_HOME, else $XDG_CACHE_HOME/diag (if absolute), else ~/.cache/diag."""
    if os.environ.get("DIAG_HOME"):
        return Path(os.environ["DIAG_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "diag"


def whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_list(value: Any, cast: Callable[[str], Any] = str.strip) -> Any:
    """"4,8" (a notebook parameter or a flag) as a list; any other value as it is."""
    return [cast(v) for v in value.split(",") if v.strip()] if isinstance(value, str) else value


@functools.cache
def _choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The Literal fields of a config and their allowed values."""
    hints = typing.get_type_hints(cls)
    return {f.name: get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


@dataclass
class ExperimentConfig:
    """Validation, quick variant, dict round-trip; Literals and shared fields checked first."""

    QUICK: ClassVar[dict[str, Any]] = {}

    def __post_init__(self) -> None:
        for name, allowed in _choices(type(self)).items():
            self._choice(name, allowed)
        if hasattr(self, "device"):
            self._check(("device",), lambda v: bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(v))),
                        "allowed values are 'auto', 'cpu', 'cuda' and 'cuda:N'")
        if hasattr(self, "on_error"):
            self._choice("on_error", ON_ERROR)
        if hasattr(self, "slow_rank"):  # a rank slowed on purpose, to see the others' comm_wait
            self._check(("slow_rank",), lambda v: whole(v) and v >= -1, "a rank (0, 1, ...) or -1 "
                        "for none")
            self._non_negative("slow_ms")
        for name in ("current_gpu", "target_gpu"):  # "" or a GPU with a dense bf16 peak
            if gpu := getattr(self, name, ""):
                from diag.machine.device import GPUS, dense_peak_flops

                if dense_peak_flops(gpu, "bf16") is None:
                    raise ValueError(f"--{name.replace('_', '-')}={gpu!r}: not a GPU with a dense "
                                     "bf16 peak in diag's table; allowed: "
                                     + ", ".join(g.name for g in GPUS if "bf16" in g.peaks))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and what is allowed."""

    @classmethod
    def quick(cls: type[T], **overrides: Any) -> T:
        """The test-sized variant: seconds, not minutes."""
        return cls(**{**cls.QUICK, **overrides})

    @classmethod
    def default(cls: type[T], quick: bool | None = None, **overrides: Any) -> T:
        """The full defaults, or quick() when `quick` is True (None: DIAG_QUICK decides)."""
        quick = quick_mode() if quick is None else quick
        return cls.quick(**overrides) if quick else cls(**overrides)

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (a Path as str, a tuple as a list)."""
        return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
                for k, v in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))}

    def _check(self, names: tuple[str, ...], ok: Callable[[Any], bool], rule: str) -> None:
        """Raise `{Config}.{name}={value!r}: {rule}` for the first field whose value is not ok."""
        for name in names:
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"{type(self).__name__}.{name}={value!r}: {rule}")

    def _positive(self, *names: str) -> None:
        self._check(names, lambda v: number(v) and v > 0, "must be a number > 0")

    def _non_negative(self, *names: str) -> None:
        self._check(names, lambda v: number(v) and v >= 0, "must be a number >= 0")

    def _whole(self, *names: str, low: int = 1) -> None:
        self._check(names, lambda v: whole(v) and v >= low, f"must be a whole number >= {low}")

    def _wholes(self, name: str, low: int, rule: str = "") -> None:
        """A list of whole numbers >= low ("4,8" parsed)."""
        setattr(self, name, parse_list(getattr(self, name), int))
        self._check((name,), lambda vs: isinstance(vs, (list, tuple)) and all(
            whole(v) and v >= low for v in vs), f"must be a list of whole numbers >= {low}{rule}")

    def _choice(self, name: str, allowed: tuple[Any, ...]) -> None:
        self._check((name,), lambda v: v in allowed,
                    "allowed values are " + ", ".join(map(repr, allowed)))
