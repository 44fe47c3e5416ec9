"""What a finished command shows: its tables (or JSON), the main table as CSV, a run folder;
an error as one line. The only place that prints a result."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from diag import config
from diag.cli.flags import UsageError
from diag.secrets import redact, redact_frame


def one_line(err: BaseException) -> str:
    if isinstance(err, UsageError):
        return str(err)
    if isinstance(err, ModuleNotFoundError):
        return (f"diag: this experiment needs the package {err.name!r}, which is not installed; "
                "install the extras with: pip install -e '.[all]' (or run `make demo`)")
    text = " ".join(str(err).split()) or type(err).__name__
    if type(err) is ValueError:  # diag's refusal of a setting: "diag: --flag=value: why; fix"
        return f"diag: {text}"
    return f"diag: {type(err).__name__}: {text}"


def show(name: str, cfg: config.ExperimentConfig, result: Any, args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    import pandas as pd

    from diag.frames import frames_of

    if isinstance(result, Path):  # a run folder: where it is and what it found
        from diag import report
        from diag.machine.contention import busy

        summary = report.load_summary(result)
        head, said = summary.get("headline"), busy(summary.get("machine") or {})
        print(redact(f"wrote {result / 'report.html'}\n"
                     + (head["text"] if head else "nothing measured stands out")
                     + (f"\n{said[0].upper() + said[1:]}" if said else "")))
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

        folder = report.write(frames, config=cfg.to_dict(), advice=frames.pop("advice", None))
        print(redact(f"wrote {folder / 'report.html'}"),
              file=sys.stderr if args.json else sys.stdout)
