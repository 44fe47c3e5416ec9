"""Score of the last `mutmut run`, per module: killed / mutants tried, and the survivors.

Reads mutmut's results under mutants/ (run from the repository root after `make mutate`).
Arguments are the mutant-name patterns that were run (as given to `mutmut run`); mutants outside
them are not counted. Each module's line counts its survivors and how many docs/mutation.md
explains (equivalent, or acceptable and why); any other survivor is a test to write. Exit 1 if a
module is under the goal.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from collections import Counter
from pathlib import Path

GOAL = 0.90
KILLED = {1, 3, 24, -24, 36, 37, 152, 255}  # mutmut's codes: test failed, timed out, type error


def _explained(doc: Path) -> set[tuple[str, int]]:
    """(function, number) pairs of the bullets in doc, e.g. "- `amdahl.findings` #37, #39: why"."""
    pairs: set[tuple[str, int]] = set()
    text = doc.read_text() if doc.exists() else ""
    for bullet in re.split(r"\n(?=- )", text):
        names = re.findall(r"`([A-Za-z_][\w.]*)`", bullet.split(":")[0])
        pairs |= {(n, int(k)) for n in names for k in re.findall(r"#(\d+)", bullet.split(":")[0])}
    return pairs


def _short(mutant: str) -> tuple[str, int]:
    """diag.amdahl.x_findings__mutmut_37 -> ("amdahl.findings", 37); methods as Class.method."""
    path, _, number = mutant.rpartition("__mutmut_")
    module, _, func = path.removeprefix("diag.").rpartition(".")
    func = func.removeprefix("x_").replace("xǁ", "").replace("ǁ", ".")
    return f"{module.rpartition('.')[2]}.{func}", int(number)


def main(patterns: list[str]) -> int:
    explained = _explained(Path("docs/mutation.md"))
    worst = 1.0
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        tried = {k: v for k, v in codes.items()
                 if v is not None and any(fnmatch.fnmatch(k, p) for p in patterns)}
        if not tried:
            continue
        module = meta.relative_to("mutants").as_posix().removesuffix(".py.meta").replace("/", ".")
        killed = sum(v in KILLED for v in tried.values())
        survivors = sorted(k for k, v in tried.items() if v not in KILLED)
        score = killed / len(tried)
        worst = min(worst, score)
        counts = Counter("killed" if v in KILLED else "survived" if v == 0 else
                         "no tests" if v in (5, 33) else f"exit {v}" for v in tried.values())
        known = [n for n in survivors if _short(n) in explained]
        print(f"{module}: {score:.1%} killed ({killed}/{len(tried)}; {dict(counts)}) "
              f"(goal >= {GOAL:.0%}); {len(survivors)} survivors, {len(known)} explained in "
              f"docs/mutation.md, {len(survivors) - len(known)} to look at")
        for name in survivors:
            note = "  (explained: docs/mutation.md)" if name in known else ""
            print(f"    {name}{note}")
    return 0 if worst >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["*"]))
