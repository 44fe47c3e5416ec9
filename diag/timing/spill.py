"""The rows a rank writes as it goes: a killed run keeps every step it finished.

`Spill(path, rank, node)` appends StageTimer rows as whole CSV lines (one write per flush, so a
kill never splits a row) to a file named *.partial.csv: it is never a complete run.
`read_spills(folder)` reads every rank's file back into one frame, dropping a line cut short.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

COLUMNS = ("stage", "seconds", "step", "rank", "node")
HEADER = ",".join(COLUMNS) + "\n"


class Spill:
    """One rank's append-only file of finished rows."""

    def __init__(self, path: str | os.PathLike[str], rank: int, node: int) -> None:
        self.path, self.rank, self.node = Path(path), rank, node
        self._file = open(path, "a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
        self._file.write(HEADER)
        self._file.flush()

    def write(self, rows: list[tuple[str, float, int | None]]) -> None:
        """Append rows (stage, seconds, step) in one write(2) of whole lines."""
        self._file.write("".join(f"{s},{sec!r},{'' if st is None else st},{self.rank},"
                                 f"{self.node}\n" for s, sec, st in rows))
        self._file.flush()

    def close(self, remove: bool = True) -> None:
        """Stop; remove the file once the complete frame is safe elsewhere."""
        self._file.close()
        if remove:
            os.unlink(self.path)


def read_spills(folder: Any) -> Any:  # -> pandas.DataFrame
    """The rows the ranks spilled (StageTimer.spill_to) before a run stopped, all ranks in one
    frame; a line cut short by a kill is dropped, never read as a number."""
    import pandas as pd

    frames = []
    for path in sorted(Path(folder).glob("rank-*.partial.csv")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        whole = [line for line in lines
                 if line.endswith("\n") and line.count(",") == len(COLUMNS) - 1]
        if len(whole) > 1:
            frames.append(pd.read_csv(io.StringIO("".join(whole))))
    if not frames:
        return pd.DataFrame(columns=list(COLUMNS))
    out = pd.concat(frames, ignore_index=True)
    out["step"] = out["step"].astype("Int64")
    return out
