"""The import graph of diag/ keeps its arrows one way (lazy imports inside functions included).

Rules (docs/architecture.md): no cycle between modules, sub-package modules included; the
analysis layers (`amdahl`, `plots`) import no experiment; no experiment imports `report`,
`plots`, `diagnose`, `widgets` or the CLI; a sub-package's own modules import each other, never
their package's face (`__init__`), which would make every sibling import the whole package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "diag"
EXPERIMENTS = {"storage", "model_load", "loader", "accum", "qlora", "toy"}
ANALYSIS = {"amdahl", "plots"}
ABOVE_EXPERIMENTS = {"report", "plots", "diagnose", "widgets", "cli", "__main__"}
# the rooms every experiment stands on: they import no experiment and nothing above them
UNDER_EXPERIMENTS = {"timing", "machine", "data", "config", "embedded", "files", "secrets", "noise",
                     "decision", "frames", "runner", "mfu"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path) -> list[str]:
    mod = _module(path).split(".")
    return mod if path.name == "__init__.py" else mod[:-1]


def imports(path: Path) -> set[str]:
    """Every diag module this file imports, anywhere in it (function bodies too)."""
    known = {_module(p) for p in ROOT.rglob("*.py")}
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package(path)[: len(_package(path)) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            # `from diag.x import y`: y may be a submodule (diag.x.y) or a name in diag.x
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]  # diag.storage.land -> diag.storage
            if name.startswith("diag"):
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    edges = {}
    for path in ROOT.rglob("*.py"):
        src = _module(path)
        edges[src] = {t for t in imports(path) if t != src and t != "diag"}
    return edges


def _noun(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            comp.append(v)
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_arrows_point_down():
    wrong = []
    for src, targets in graph().items():
        for t in targets:
            s, n = _noun(src), _noun(t)
            if s == n:
                continue
            if s in ANALYSIS and n in EXPERIMENTS:
                wrong.append(f"{src} (analysis) imports experiment {t}")
            if s in EXPERIMENTS and n in ABOVE_EXPERIMENTS:
                wrong.append(f"experiment {src} imports {t}")
            if s in UNDER_EXPERIMENTS and n in EXPERIMENTS | ABOVE_EXPERIMENTS | ANALYSIS:
                wrong.append(f"{src} (under the experiments) imports {t}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_data_layer_is_under_the_experiments_and_the_recipe_imports_faces():
    # STYLE.md: shared data pieces live under the experiments; the QLoRA recipe on top imports
    # the experiments' faces (diag.accum), never their modules (diag.accum.sweep)
    wrong = []
    for src, targets in graph().items():
        for t in targets:
            if _noun(src) == "data" and _noun(t) in EXPERIMENTS:
                wrong.append(f"{src} (data layer) imports experiment {t}")
            if _noun(src) == "qlora" and _noun(t) in EXPERIMENTS - {"qlora"} \
                    and t.count(".") > 1:
                wrong.append(f"{src} imports {t}, not its face {t.rsplit('.', 1)[0]}")
    assert not wrong, "\n".join(sorted(wrong))


def test_sub_package_modules_do_not_import_their_face():
    wrong = []
    for path in ROOT.rglob("*.py"):
        pkg = _package(path)
        if len(pkg) < 2 or path.name == "__init__.py":
            continue
        face = ".".join(pkg)
        if face in imports(path):
            wrong.append(f"{_module(path)} imports its package face {face}")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path):
    # the checker itself must be able to fail: a lazy import inside a function is an arrow
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from diag.report import write\n")
    assert imports(src) == {"diag.report"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_files_stay_readable():
    # ~300 lines a file (STYLE.md): a module that outgrows it is a noun that wants a sub-package
    long = {_module(p): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 360}
    assert not long, f"modules over 360 lines: {long}"
