"""The rows a rank writes as it goes (*.partial.csv, never a complete run): a killed run keeps
every step it finished. `read_spills(folder)` reads every rank's back, dropping a line cut short.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

COLUMNS = ("stage", "seconds", "step", "rank", "node")
HEADER = ",".join(COLUMNS) + "\n"


class Spill:
    """One rank's append-only file of finished rows, whole CSV lines in one write per flush."""

    def __init__(self, path: str | os.PathLike[str], rank: int, node: int) -> None:
        self.path, self.rank, self.node = Path(path), rank, node
        self._file = open(path, "a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
        self._file.write(HEADER)
        self._file.flush()

    def write(self, rows: list[tuple[str, float, int | None]]) -> None:
        self._file.write("".join(f"{s},{sec!r},{'' if st is None else st},{self.rank},"
                                 f"{self.node}\n" for s, sec, st in rows))
        self._file.flush()

    def close(self) -> None:
        """Stop and remove the file: the complete frame is safe elsewhere."""
        self._file.close()
        os.unlink(self.path)


def read_spills(folder: Any) -> Any:  # -> pandas.DataFrame
    """Every rank's spilled rows in one frame; a line cut short by a kill is dropped."""
    import pandas as pd

    frames = []
    for path in sorted(Path(folder).glob("rank-*.partial.csv")):
        whole = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                 if line.endswith("\n") and line.count(",") == len(COLUMNS) - 1]
        if len(whole) > 1:
            frames.append(pd.read_csv(io.StringIO("".join(whole))))
    if not frames:
        return pd.DataFrame(columns=list(COLUMNS))
    return pd.concat(frames, ignore_index=True).astype({"step": "Int64"})
