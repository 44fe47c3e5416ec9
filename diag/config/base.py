"""The base every experiment config builds on, and the names every layer shares.

`ExperimentConfig`: validation in `__post_init__`, `quick()` (the test-sized variant),
`default(quick=None)` (DIAG_QUICK decides, read here only). `diag_home()`: where diag keeps files.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args

T = TypeVar("T", bound="ExperimentConfig")

# names every layer shares, defined once (the CLI offers them as choices)
DEVICES = ("auto", "cpu", "cuda")  # and "cuda:N"
Scenario = Literal["fresh", "cached", "cached_offline", "cached_cold"]
MODEL_LOAD_SCENARIOS: tuple[str, ...] = get_args(Scenario)
LoadProcess = Literal["fork", "exec"]
MODEL_LOAD_PROCESSES: tuple[str, ...] = get_args(LoadProcess)
STORAGE_PULLS = ("boto3_default", "boto3_tuned", "s5cmd")
Verify = Literal["sha256", "size"]
VERIFY_MODES: tuple[str, ...] = get_args(Verify)


def quick_mode() -> bool:
    """True when DIAG_QUICK is set to anything but '', '0', 'false' or 'no'."""
    return os.environ.get("DIAG_QUICK", "").strip().lower() not in ("", "0", "false", "no")


def diag_home() -> Path:
    """Where diag keeps assets and caches: $DIAG_HOME, else $XDG_CACHE_HOME/diag (if absolute),
    else ~/.cache/diag."""
    home = os.environ.get("DIAG_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "diag"


@dataclass
class ExperimentConfig:
    """Base of every experiment config: validation, quick variant, dict round-trip."""

    QUICK: ClassVar[dict[str, Any]] = {}

    def __post_init__(self) -> None:
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

    @classmethod
    def used_fields(cls) -> list[str]:
        """The fields this config reads: its command offers a flag for each."""
        return [f.name for f in dataclasses.fields(cls)]

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{type(self).__name__}.{name}={value!r}: must be a number > 0")

    def _non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{type(self).__name__}.{name}={value!r}: must be a number >= 0")

    def _choice(self, name: str, allowed: tuple[Any, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(
                f"{type(self).__name__}.{name}={value!r}: allowed values are "
                + ", ".join(repr(a) for a in allowed)
            )

    def _device(self, name: str = "device") -> None:
        value = getattr(self, name)
        head, colon, index = str(value).partition(":")
        if head not in DEVICES or (colon and (head != "cuda" or not index.isdigit())):
            raise ValueError(f"{type(self).__name__}.{name}={value!r}: allowed values are "
                             + ", ".join(map(repr, DEVICES)) + " and 'cuda:N'")

    def _straggler(self) -> None:
        """slow_rank / slow_ms: a rank slowed on purpose, to see the others' comm_wait."""
        if isinstance(self.slow_rank, bool) or not isinstance(self.slow_rank, int) \
                or self.slow_rank < -1:
            raise ValueError(f"{type(self).__name__}.slow_rank={self.slow_rank!r}: a rank (0, 1, "
                             "...) or -1 for none")
        self._non_negative("slow_ms")


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value
