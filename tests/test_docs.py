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
                out |= {e.value: node for e in node.value.elts}  # type: ignore[attr-defined]
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
