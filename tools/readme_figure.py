"""The example run that README.md and docs/workshop.md quote, and the README picture: one tool,
so that every number they quote is one run's, on one box.

    python tools/readme_figure.py        (make readme-figure; about 25 min on 2 busy cores)

It runs the demo as a user does (`python -m diag run --quick`, in its own process), then each
notebook top to bottom in quick mode (papermill, a real kernel): 00_tour measuring in its kernel
as a student runs it, 05_stage_shares and 07_train on the demo's run folder. Each is timed with
the load average before and after. It writes docs/example/ whole or not at all: the demo's
summary.json, CSVs and figures (report.html left out: `python -m diag report` makes it),
timings.csv and headline.png (the stage shares under the headline the command printed).
tests/test_docs.py checks that the README and the workshop quote these numbers.
"""

from __future__ import annotations

import html
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pandas as pd

from diag import plots, report
from diag.report.page import device_line

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "example"
DEMO = "python -m diag run --quick"  # the step's name in timings.csv
FROM_DEMO = {"05_stage_shares", "07_train"}  # notebooks that read the demo's run folder


def figure(folder: Path):
    """The stage shares of a `diag run` folder under its headline (a matplotlib Figure)."""
    summary = report.load_summary(folder)
    head = summary.get("headline")
    if not head:
        raise SystemExit(f"{folder}: no headline; name a `diag run` folder")
    lines = [*(w for line in head["text"].split("\n") for w in textwrap.wrap(line, 100)),
             f"measured on {html.unescape(device_line(summary))}"]
    fig = plots.plot_stage_shares(pd.DataFrame(summary["stages"]), title="\n".join(lines))
    fig.axes[0].title.set_fontsize(10)  # four lines of words above a 9-inch chart
    fig.set_size_inches(9, 2.4 + 0.25 * len(lines))
    return fig


def timed(step: str, command: list[str], cwd: Path) -> dict[str, object]:
    """Run command (check=True) and time it, with the 1-minute load average either side."""
    before, started = os.getloadavg()[0], time.perf_counter()
    subprocess.run(command, cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "DIAG_QUICK": "1"})
    return {"step": step, "seconds": round(time.perf_counter() - started, 1),
            "load_before": round(before, 1), "load_after": round(os.getloadavg()[0], 1)}


def main() -> int:
    if not shutil.which("papermill", path=str(Path(sys.executable).parent)):
        raise SystemExit("papermill is missing: pip install -c constraints.txt -e '.[notebooks]'")
    with tempfile.TemporaryDirectory() as scratch:
        work, run = Path(scratch), Path(scratch) / "run"
        rows = [timed(DEMO, [sys.executable, "-m", "diag", "run", "--quick", "--out", str(run)],
                      ROOT)]
        for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
            given = ["-p", "results", str(run)] if notebook.stem in FROM_DEMO else []
            rows.append(timed(notebook.stem, [
                str(Path(sys.executable).parent / "papermill"), str(notebook),
                str(work / notebook.name), "-p", "quick", "True", *given, "--cwd", str(work),
                "--no-progress-bar", "--kernel", "python3"], work))
            print(f"{notebook.stem}: {rows[-1]['seconds']} s", flush=True)
        new = OUT.with_name(OUT.name + ".new")
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir(parents=True)
        for path in run.iterdir():
            if path.suffix in (".csv", ".png", ".json"):
                shutil.copy2(path, new / path.name)
        cpu = report.load_summary(run)["device"].get("cpu_model") or platform.processor()
        pd.DataFrame(rows).assign(cpu=cpu, cores=os.cpu_count(), when_utc=time.strftime(
            "%Y-%m-%d %H:%M", time.gmtime())).to_csv(new / "timings.csv", index=False)
        figure(run).savefig(new / "headline.png", dpi=110, format="png", bbox_inches="tight")
    old = OUT.with_name(OUT.name + ".old")
    if OUT.exists():  # swapped whole: a failed run above left the committed folder as it was
        OUT.rename(old)
    new.rename(OUT)
    shutil.rmtree(old, ignore_errors=True)
    print(f"wrote {OUT.relative_to(ROOT)}: " + ", ".join(f"{r['step']} {r['seconds']} s"
                                                         for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
