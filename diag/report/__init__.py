"""A run folder a person can open: one CSV per experiment, summary.json, PNG figures, report.html.

`write(frames)` assembles the folder whole (folder.py); `render(DIR)` redraws its figures and the
page (page.py: the headline and the fixes first, then a section per experiment) from its CSVs.
"""

from diag.report.folder import (capped, gpu_marks, headline, load, load_summary, render,
                                run_report, write)

__all__ = ["capped", "gpu_marks", "headline", "load", "load_summary", "render", "run_report",
           "write"]
