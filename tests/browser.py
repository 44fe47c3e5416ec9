"""What the browser tests need: Debian's chromium found (or why not), a JupyterLab server started
on a free loopback port and always stopped, and a Playwright page that reaches nothing but
loopback and files.

Every wait has a timeout; every failure is one line naming its cause (LabError).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_CHROMIUM = 120  # Playwright 1.65 speaks the DevTools protocol of recent Chromium releases
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ENABLE = ("install it to run them: apt-get install -y chromium (and pip install -c constraints.txt "
          "-e '.[browser]'; make test does that)")


class LabError(RuntimeError):
    """The lab or the browser could not be used; the message is one line naming the cause."""


def chromium() -> tuple[str | None, str]:
    """(path of a usable chromium, "") or (None, why not: one line)."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return None, f"browser tests skipped: Playwright is not installed; {ENABLE}"
    path = os.environ.get("DIAG_CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")
    if not path:
        return None, f"browser tests skipped: no chromium on PATH; {ENABLE}"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"browser tests skipped: {path} --version failed ({error}); {ENABLE}"
    found = re.search(r"(\d+)\.\d+\.\d+", out)
    if not found:
        return None, f"browser tests skipped: {path} --version printed no version ({out.strip()!r})"
    if int(found.group(1)) < MIN_CHROMIUM:
        return None, (f"browser tests skipped: chromium {found.group(0)} is too old (need "
                      f">= {MIN_CHROMIUM}); {ENABLE}")
    return path, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    url: str  # http://127.0.0.1:PORT
    token: str
    root: Path  # the server's root_dir
    proc: subprocess.Popen
    log: Path

    def page_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}&reset"


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "rror" in ln or "already in use" in ln]
    return (errors or lines or ["(no output)"])[-1][:300]


def stop(proc: subprocess.Popen) -> None:
    """The lab and its kernels end: SIGTERM to the process group, SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def lab(root: Path, launch: list[str], env: dict[str, str], port: int | None = None,
        start_timeout_s: float = 90) -> Iterator[Lab]:
    """JupyterLab on 127.0.0.1 (token auth, no browser, no update checks), served from root;
    stopped on exit, whatever happened. launch: the command that starts it in the environment
    the lab runs from (venv_lab() or second_env()); it offers the kernels registered there."""
    port = port or free_port()
    token = secrets.token_hex(16)
    root.mkdir(parents=True, exist_ok=True)
    state = root.parent / f"jupyter-state-{port}"
    for sub in ("config", "data", "runtime", "workspaces", "settings"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    # no "get notified about Jupyter news?" toast over the page (and no fetch for it)
    news = state / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True, exist_ok=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    env = dict(env, JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_DATA_DIR=str(state / "data"),
               JUPYTER_RUNTIME_DIR=str(state / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"),
               JUPYTERLAB_SETTINGS_DIR=str(state / "settings"), JUPYTER_PLATFORM_DIRS="1")
    log = state / "lab.log"
    cmd = [*launch, "--no-browser", "--ServerApp.open_browser=False", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           *(["--allow-root"] if os.geteuid() == 0 else [])]  # CI containers run as root
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise LabError(f"jupyter lab exited (code {proc.returncode}) before serving on "
                               f"port {port}: {_last_line(log)}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise LabError(f"jupyter lab did not answer on {url} within "
                               f"{start_timeout_s:.0f} s: {_last_line(log)}")
            time.sleep(0.5)
        yield Lab(url=url, token=token, root=root, proc=proc, log=log)
    finally:
        stop(proc)


def shutdown_kernels(lab: Lab, timeout_s: float = 30) -> None:
    """End every kernel the lab runs (its REST API), as closing a notebook's kernel does."""
    import json

    base = f"{lab.url}/api/kernels"
    auth = {"Authorization": f"token {lab.token}"}
    with urllib.request.urlopen(urllib.request.Request(base, headers=auth),
                                timeout=timeout_s) as r:
        kernels = json.loads(r.read())
    for kernel in kernels:
        request = urllib.request.Request(f"{base}/{kernel['id']}", headers=auth, method="DELETE")
        with urllib.request.urlopen(request, timeout=timeout_s):
            pass


@contextmanager
def browser(executable: str, *, allow: tuple[str, ...] = ()) -> Iterator[Any]:
    """A Playwright page in headless chromium (a fresh profile). Requests go only to the origins
    in allow (prefix match), data: and file: URLs; every other one is aborted and recorded in
    page.blocked, console errors in page.console_errors."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        try:
            engine = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS,
                                        timeout=60_000)
        except Exception as error:  # one line: the cause, not Playwright's call log
            raise LabError(f"chromium at {executable} did not start: "
                           f"{str(error).splitlines()[0][:300]}") from None
        try:
            context = engine.new_context(viewport={"width": 1280, "height": 1600})
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.blocked, page.console_errors = [], []

            def route(r: Any) -> None:
                url = r.request.url
                if url.startswith(("data:", "file:", "blob:", *allow)):
                    r.continue_()
                else:
                    page.blocked.append(url)
                    r.abort()

            context.route("**/*", route)
            page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
            page.on("pageerror", lambda e: page.console_errors.append(str(e)))
            yield page
        finally:
            engine.close()


def copy_notebooks(src: Path, dst: Path, names: list[str]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy2(src / name, dst / name)


def python_env(root: Path) -> dict[str, str]:
    """The server's environment: this process' (DIAG_QUICK, DIAG_HOME and the fake HF_TOKEN from
    conftest) with this checkout importable by the kernels."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env.pop("JUPYTER_PATH", None)
    return env


def venv_lab() -> list[str]:
    """JupyterLab from the project's environment (what `make lab` runs)."""
    return [str(Path(sys.executable).parent / "jupyter"), "lab"]


def second_env(folder: Path, *, widgets: bool) -> list[str]:
    """A lab the user already runs, in an environment of its own: only the `diag` kernel is
    registered there (`python -m ipykernel install --prefix ... --name diag`, run by the project's
    python as the README says). The environment is a venv whose JupyterLab comes from the
    project's site-packages through a .pth (a pip install of jupyterlab takes minutes here); what
    decides what the lab's front end can draw is its own share/jupyter, which holds the lab's
    assets and, only when widgets=True, the widgets extension (what `pip install
    jupyterlab_widgets` puts there). Returns the command that starts that lab."""
    import sysconfig

    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    site = next(folder.glob("lib/python*/site-packages"))
    (site / "project-site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    share, ours = folder / "share" / "jupyter", Path(sys.prefix) / "share" / "jupyter"
    share.mkdir(parents=True, exist_ok=True)
    (share / "lab").symlink_to(ours / "lab")  # JupyterLab's built app and themes
    if widgets:
        (share / "labextensions").mkdir()
        (share / "labextensions" / "@jupyter-widgets").symlink_to(
            ours / "labextensions" / "@jupyter-widgets")
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(folder),
                    "--name", "diag", "--display-name", "diag"], check=True, timeout=120,
                   capture_output=True)
    return [str(folder / "bin" / "python"), "-m", "jupyterlab"]


def set_kernel(path: Path, name: str, display: str) -> None:
    """The notebook asks for kernel `name` (as one saved after picking that kernel would)."""
    import json

    nb = json.loads(path.read_text())
    nb["metadata"]["kernelspec"] = {"name": name, "display_name": display, "language": "python"}
    path.write_text(json.dumps(nb, indent=1))


# -- driving a notebook in JupyterLab ------------------------------------------------------------
PROMPTS = "() => Array.from(document.querySelectorAll(" \
          "'.jp-Notebook .jp-CodeCell .jp-InputPrompt'))" \
          ".map(e => e.textContent.trim())"


def open_notebook(page: Any, lab: Lab, name: str, kernel: str, timeout_s: float = 120) -> None:
    """Open name and wait until its kernel (display name starting with kernel) is idle."""
    page.goto(lab.page_url(name))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
    try:
        page.wait_for_function(
            "(k) => { const n = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) "
            ".jp-KernelName, .jp-NotebookPanel .jp-Toolbar-kernelName');"
            " const i = document.querySelector('.jp-Notebook-ExecutionIndicator');"
            " return n && n.textContent.trim().startsWith(k)"
            " && i && i.dataset.status === 'idle'; }",
            arg=kernel, timeout=timeout_s * 1000)
    except Exception:
        raise LabError(f"{name}: kernel {kernel!r} did not start within {timeout_s:.0f} s "
                       f"(the page shows kernel {_kernel_name(page)!r}); lab log: "
                       f"{_last_line(lab.log)}") from None


def _kernel_name(page: Any) -> str:
    return page.evaluate("() => (document.querySelector('.jp-KernelName, .jp-Toolbar-kernelName')"
                         " || {textContent: ''}).textContent.trim()")


def run_cells(page: Any, count: int) -> None:
    """Shift+Enter on `count` cells from the first, as a person does: click the first cell's
    prompt (selects it and gives the notebook the keyboard), Escape, then the keys. Keys sent
    before the notebook held the focus were seen lost once on a fresh clone (every prompt still
    `[ ]:` 240 s later): until the first cell is queued or run, the sequence is sent again."""
    first = page.locator(".jp-Notebook .jp-Cell").first
    for _ in range(3):
        first.locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")  # command mode
        for _ in range(count):
            page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function(f"() => {{ const p = ({PROMPTS})(); return p.length > 0 && "
                                   "p[0] !== '[ ]:'; }", timeout=10_000, polling=250)
            return
        except Exception:
            continue


def run_menu(page: Any, item: str) -> None:
    """An item of the Run menu, e.g. 'Run All Cells', 'Run Selected Cell and All Below'."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def wait_executed(page: Any, name: str, timeout_s: float) -> None:
    """Every code cell shows an execution count ([n]); a cell still running shows [*]."""
    try:
        page.wait_for_function(f"() => {{ const p = ({PROMPTS})(); return p.length > 0 && "
                               "p.every(t => /\\[\\d+\\]/.test(t)); }",
                               timeout=timeout_s * 1000, polling=500)
    except Exception:
        prompts = page.evaluate(PROMPTS)
        stuck = [i for i, t in enumerate(prompts) if not re.search(r"\[\d+\]", t)]
        raise LabError(f"{name}: code cells {stuck} not executed within {timeout_s:.0f} s "
                       f"(prompts {[prompts[i] for i in stuck][:5]})") from None


def images(page: Any, within: str = "body") -> list[dict[str, Any]]:
    """Every <img> under the selector: its alt, whether it loaded, its natural size."""
    return page.evaluate(
        "(sel) => Array.from(document.querySelectorAll(sel + ' img')).map(i => ({alt: i.alt,"
        " complete: i.complete, width: i.naturalWidth, height: i.naturalHeight}))", within)


def save(page: Any) -> None:
    page.keyboard.press("Control+s")
    page.wait_for_function("() => !document.querySelector('.jp-mod-dirty')", timeout=30_000)


def wait_executed_first(page: Any, count: int, timeout_s: float) -> None:
    """The first `count` code cells show an execution count."""
    try:
        page.wait_for_function(f"() => {{ const p = ({PROMPTS})().slice(0, {count}); return "
                               f"p.length === {count} && p.every(t => /\\[\\d+\\]/.test(t)); }}",
                               timeout=timeout_s * 1000, polling=500)
    except Exception:
        raise LabError(f"the first {count} code cells did not run within {timeout_s:.0f} s "
                       f"(prompts {page.evaluate(PROMPTS)[:count]})") from None
