"""The two install routes agree: environment.yml (conda, GPU boxes) and constraints.txt (pip)."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.split("[")[0]).lower()


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_norm(name)] = version
    return pins


def _environment_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"^\s+- ([A-Za-z0-9_.\-\[\]]+)==([^\s#]+)", line)
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def test_environment_yml_pins_match_constraints():
    env, pins = _environment_pins(), _constraints()
    assert env, "environment.yml lists no pinned pip packages"
    mismatched = {n: (v, pins.get(n)) for n, v in env.items() if pins.get(n) != v}
    assert not mismatched, f"environment.yml vs constraints.txt: {mismatched}"


def test_every_direct_dependency_is_pinned_in_both():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra, reqs in project["optional-dependencies"].items():
        wanted += [r for r in reqs if not r.startswith("diag[")]
    names = {_norm(re.split(r"[<>=!~ ;]", r, maxsplit=1)[0]) for r in wanted}
    env, pins = _environment_pins(), _constraints()
    assert names - set(pins) == set(), f"not pinned in constraints.txt: {names - set(pins)}"
    assert names - set(env) == set(), f"not in environment.yml: {names - set(env)}"


def test_torch_is_pinned_exactly_without_a_local_build_tag():
    # torch==2.13.0 takes the CPU file here and the CUDA build on a GPU box; "+cpu" would not.
    assert _constraints()["torch"] == "2.13.0"
    assert _environment_pins()["torch"] == "2.13.0"
