"""The README's figure: what a `make demo` run gives, the headline over the stage shares.

    python tools/readme_figure.py [RUN_FOLDER]    (make readme-figure [RUN=runs/<id>])

Without a folder it runs the demo first (`python -m diag run`, about 100 s on 2 cores); with one
it re-draws that folder. Writes docs/demo-stage-shares.png: the stage-share chart of the naive
and optimized runs under the headline the CLI prints (naive -> optimized, the ratio, the largest
stage), the top fix and the machine. Re-run it when a change moves the demo's numbers.
"""

from __future__ import annotations

import html
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pandas as pd

from diag import plots, report
from diag.files import atomic_file
from diag.report.page import device_line

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "demo-stage-shares.png"


def figure(folder: Path):
    """The stage shares of a `diag run` folder under its headline (a matplotlib Figure)."""
    summary = report.load_summary(folder)
    head = summary.get("headline")
    if not head:
        raise SystemExit(f"{folder}: no naive vs optimized headline; name a `diag run` folder")
    lines = [*(w for line in head["text"].split("\n") for w in textwrap.wrap(line, 100)),
             f"measured on {html.unescape(device_line(summary))}"]
    fig = plots.plot_stage_shares(pd.DataFrame(summary["stages"]), title="\n".join(lines))
    fig.axes[0].title.set_fontsize(10)  # three lines of words above a 9-inch chart
    fig.set_size_inches(9, 2.4 + 0.25 * len(lines))
    return fig


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(argv[0]) if argv else Path(scratch) / "demo"
        if not argv:  # the demo's own command, in its own process, as a user runs it
            subprocess.run([sys.executable, "-m", "diag", "run", "--out", str(folder)], check=True)
        with atomic_file(OUT) as tmp:  # a failed draw leaves the committed image as it was
            figure(folder).savefig(tmp, dpi=110, format="png", bbox_inches="tight")
    print(f"wrote {OUT.relative_to(ROOT)} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
