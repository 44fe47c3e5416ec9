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


def _direct(*skip: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra, reqs in project["optional-dependencies"].items():
        if extra not in skip:
            wanted += [r for r in reqs if not r.startswith("diag[")]
    return {_norm(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0]) for r in wanted}


def test_every_direct_dependency_is_pinned_in_both():
    names, env, pins = _direct(), _environment_pins(), _constraints()
    assert names - set(pins) == set(), f"not pinned in constraints.txt: {names - set(pins)}"
    # the conda route registers a kernel with the user's own JupyterLab: no `lab` extra there
    # (nor the browser tests: they are for make test and CI)
    missing = _direct("lab", "browser") - set(env)
    assert missing == set(), f"not in environment.yml: {missing}"


def test_lean_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    # never imported / brought by papermill / only for `make lab`: not in the default install
    assert not {"s3fs", "nbclient", "nbformat"} & _direct()
    assert "jupyterlab" not in _direct("lab") and "lab" not in extras["all"][0]
    # moto's S3 backend and its server, not moto[server] (cfn-lint, docker, graphql...)
    assert "moto[s3]>=5" in extras["embedded"] and "embedded" in extras["all"][0]
    assert not {"s3fs", "cfn-lint", "docker", "aiobotocore"} & set(_constraints())


def test_diag_home_follows_xdg_cache_home(monkeypatch, tmp_path):
    from diag.config import diag_home

    monkeypatch.delenv("DIAG_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert diag_home() == tmp_path / "xdg" / "diag"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the spec says: ignore a relative one
    assert diag_home() == Path.home() / ".cache" / "diag"
    monkeypatch.setenv("DIAG_HOME", str(tmp_path / "mine"))
    assert diag_home() == tmp_path / "mine"


def test_torch_is_pinned_exactly_without_a_local_build_tag():
    # torch==2.13.0 takes the CPU file here and the CUDA build on a GPU box; "+cpu" would not.
    assert _constraints()["torch"] == "2.13.0"
    assert _environment_pins()["torch"] == "2.13.0"


def test_missing_embedded_extra_is_named(monkeypatch):
    import importlib.util

    import pytest

    from diag.embedded.servers import S3Server

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flask_cors" else real(name, *a))
    server = S3Server()
    with pytest.raises(RuntimeError, match=r"needs flask_cors: .*pip install 'diag\[embedded\]'"):
        server.start()
    assert server.proc is None  # nothing was started
