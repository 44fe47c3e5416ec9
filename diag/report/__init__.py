"""A run folder a person can open: one CSV per experiment, summary.json, PNG figures, report.html.

`write(frames)` assembles the folder whole (folder.py); `render(DIR)` redraws its figures and
the page from its CSVs, as `python -m diag report DIR` does. The page (page.py) opens with the
headline and the ranked fixes, then one section per experiment: its conclusion, its figure, its
tables folded and linked; numbers are shown with the unit their column names (units.py).
"""

from diag.report.folder import (capped, gpu_marks, headline, load, load_summary, render,
                                run_report, write)

__all__ = ["capped", "gpu_marks", "headline", "load", "load_summary", "render", "run_report",
           "write"]
