"""The docs and the notebooks tell one story: every diag name they cite exists."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FILES = {"html", "csv", "png", "json", "md", "py", "ipynb"}  # report.html is a file, not a name


def _text(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])


def cited(text: str) -> set[str]:
    """diag.x.y names, `from diag.x import y` names and, for `from diag import m`, `m.y`."""
    names = set(re.findall(r"\bdiag(?:\.[A-Za-z_]\w*)+", text))
    for module, items in re.findall(r"from (diag[\w.]*) import ([\w, ]+)", text):
        names |= {f"{module}.{item.strip()}" for item in items.split(",") if item.strip()}
    modules = {m.strip() for items in re.findall(r"from diag import ([\w, ]+)", text)
               for m in items.split(",")}
    for module, attr in re.findall(r"(?<![\w.])(\w+)\.([A-Za-z_]\w*)", text):
        if module in modules and attr not in FILES:
            names.add(f"diag.{module}.{attr}")
    return names


def _bound(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body binds (def, class, assignment, import; `__all__`'s)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        out[leaf.id] = node
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                for e in node.value.elts:  # type: ignore[attr-defined]
                    # a starred tuple of names (diag.data's lazy ones): its strings
                    names = (out[e.value.id].value.elts if isinstance(e, ast.Starred) else [e])
                    out |= {n.value: node for n in names}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0]: node for a in node.names}
    return out


def exists(name: str) -> bool:
    """Whether diag defines `name` (a module, or what a module or its class binds), read from
    the source without importing it (diag.TimingCallback would import transformers)."""
    parts, folder = name.split("."), ROOT
    for i, part in enumerate(parts):
        if (folder / part / "__init__.py").is_file():
            folder = folder / part
            if i == len(parts) - 1:
                return True
            continue
        if (folder / f"{part}.py").is_file():
            body, rest = ast.parse((folder / f"{part}.py").read_text()).body, parts[i + 1:]
        else:
            body, rest = ast.parse((folder / "__init__.py").read_text()).body, parts[i:]
        for attr in rest:
            node = _bound(body).get(attr)
            if node is None:
                return False
            body = node.body if isinstance(node, ast.ClassDef) else []
        return True
    return False


def test_every_diag_name_a_doc_or_notebook_cites_exists():
    missing = [f"{path.relative_to(ROOT)}: {name}" for path in [*DOCS, *NOTEBOOKS]
               for name in sorted(cited(_text(path))) if not exists(name)]
    assert not missing, missing


EXAMPLE = ROOT / "docs" / "example"  # made by tools/readme_figure.py
DEMO = "python -m diag run --quick"


def quoted(folder: Path = EXAMPLE) -> dict[str, list[str]]:
    """What README.md and docs/workshop.md must say, each figure as they write it, from the
    example run folder (its summary, CSVs and timings.csv)."""
    import pandas as pd

    from diag import model_load, report, storage

    frames, head = report.load(folder), report.load_summary(folder)["headline"]
    times = pd.read_csv(folder / "timings.csv")
    loads = times[["load_before", "load_after"]]
    box = [f"{times['cpu'].iloc[0]}, {times['cores'].iloc[0]} cores",
           f"between {loads.min().min():.1f} and {loads.max().max():.1f}"]
    demo = times.set_index("step").loc[DEMO, "seconds"]
    pull = storage.medians(frames["storage"]).set_index(["method", "cache_state"])["mb_per_s"]
    fresh = model_load.medians(frames["model_load"]).loc["fresh"]
    naive = frames["loader_recommendation"].set_index("pipeline").loc["naive"]
    accum = frames["accum_summary"].sort_values("tokens_per_s")
    best, worst = accum.iloc[-1], accum.iloc[0]
    train = frames["qlora_savings"].set_index("stage").loc["train"]
    losses = frames["qlora"].set_index("plan")["final_loss"]
    return {"README.md": [*head["text"].split("\n"), *box, f"took {demo:.0f} s"],
            "docs/workshop.md": [
                *head["text"].split("\n"), *box,
                *(f"| `{r.step}` | {r.seconds:.0f} s |" for r in times.itertuples()),
                *(f"{pull[key]:.0f} MB/s" for key in [("boto3_default", "remote"),
                                                      ("local_read", "cold"),
                                                      ("local_read", "warm")]),
                f"{25_000 / pull['boto3_default', 'remote']:.0f} s per start",
                f"{fresh['import']:.1f} s of the {fresh['load_model']:.1f} s",
                f"{naive['data_wait_share']:.1%} of the {naive['step_ms']:.0f} ms step",
                f"{best['micro_batch']} x {best['grad_accum']} reached "
                f"{best['tokens_per_s']:,.0f} tokens/s",
                f"{worst['tokens_per_s']:,.0f} for {worst['micro_batch']} x {worst['grad_accum']}",
                f"{train['measured_s']:.3g} CPU s measured against {train['predicted_s']:.3g} "
                "predicted",
                f"{losses['naive']:.2f} (naive) and {losses['optimized']:.2f} (optimized)"]}


def test_the_example_run_is_whole_and_readable():
    from diag import report

    frames = report.load(EXAMPLE)  # every CSV its summary lists
    assert {"run", "qlora_comparison", "qlora_waterfall", "storage", "model_load"} <= set(frames)
    assert (EXAMPLE / "headline.png").stat().st_size > 10_000
    assert {"stage_shares.png", "waterfall.png"} <= {p.name for p in EXAMPLE.glob("*.png")}


def test_the_readme_and_the_workshop_quote_the_example_run():
    def flat(text: str) -> str:  # a quote may wrap across lines of the markdown
        return " ".join(text.split())

    missing = {doc: [q for q in quotes if flat(q) not in flat((ROOT / doc).read_text())]
               for doc, quotes in quoted().items()}
    assert not any(missing.values()), missing
