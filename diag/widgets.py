"""The notebook panel: pick source, model, sweeps and plan, press Run, watch each step's view.

`panel()` returns the widget tree; Run starts run_diagnose in a thread (the kernel still hears
Stop); a failed step is one line in its view. Everything shown is redacted (diag.secrets).
"""

from __future__ import annotations

import base64
import contextvars
import ctypes
import io
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import pandas as pd

from diag import amdahl, model_load, plots, storage
from diag.config import DiagnoseConfig, SourceConfig, quick_mode
from diag.decision import chosen
from diag.diagnose import STEPS, run_diagnose, steps
from diag.runner import Stopped, quiet
from diag.secrets import redact, redact_frame

PLANS = ("both", "naive", "optimized")
# What a front end without the widgets extension shows instead of `VBox(children=...)`
NO_WIDGETS = ("The diag panel needs the Jupyter widgets front end in the environment JupyterLab "
              "runs from (not only in this kernel's): pip install jupyterlab_widgets (or "
              "ipywidgets) there, restart JupyterLab and reload the page. The cells below run "
              "without it.")
View = Callable[[dict[str, pd.DataFrame]], list[Any]]


def _runs(frames: dict[str, pd.DataFrame]) -> list[Any]:
    table = amdahl.shares(frames["run"])
    return [frames["qlora"] if "qlora" in frames else table, plots.plot_stage_shares(table)]


# Diagnosis field (diag.diagnose.STEPS) -> what the panel shows once its step has measured
VIEWS: dict[str, View] = {
    "info": lambda f: [f["info"]],
    "storage": lambda f: [storage.medians(f["storage"]), f["storage_tax"],
                          plots.plot_storage(f["storage"])],
    "model_load": lambda f: [model_load.medians(f["model_load"]),
                             plots.plot_model_load(f["model_load"])],
    "loader": lambda f: [f["loader_recommendation"],
                         plots.plot_loader(f["loader"], decision=chosen(f, "num_workers"))],
    "loader_projected": lambda f: [f["loader_projected_recommendation"],
                                   plots.plot_loader(f["loader_projected"])],
    "accum": lambda f: [f["accum_summary"],
                        plots.plot_accum(f["accum"], chosen(f, "micro_batch"))],
    "checkpointing": lambda f: [f["checkpointing"]],
    "qlora": _runs,
    "qlora_projection": lambda f: [f["qlora_projection"]],
    "train": lambda f: [f["train_eta"], plots.plot_losses(f["train_losses"])],
    "runs": _runs,
    "accum_advice": lambda f: [amdahl.findings(f["run"]),
                               plots.plot_amdahl(amdahl.shares(f["run"]))],
}


def parse_ints(text: str, name: str) -> list[int]:
    """'0, 1, 2' -> [0, 1, 2]; '' -> [] (the experiment's default)."""
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ValueError(f"{name}={text!r}: must be whole numbers separated by commas") from None


def _mime(item: Any) -> dict[str, Any]:
    """One output (a frame or a matplotlib Figure) as a redacted Jupyter display_data dict."""
    if isinstance(item, pd.DataFrame):
        shown = redact_frame(item)
        data = {"text/html": redact(shown.to_html(max_rows=40)),
                "text/plain": redact(shown.to_string(max_rows=40))}
    elif hasattr(item, "savefig"):
        import matplotlib.pyplot as plt

        buffer = io.BytesIO()
        item.savefig(buffer, format="png", dpi=90)
        plt.close(item)
        data = {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
                "text/plain": "<Figure>"}
    else:
        data = {"text/plain": redact(str(item))}
    return {"output_type": "display_data", "data": data, "metadata": {}}


@dataclass
class Panel:
    """The widget tree and what the last Run produced."""
    box: Any  # the ipywidgets.VBox to display
    source: Any
    model: Any
    workers: Any
    micro_batches: Any
    plan: Any
    quick: Any
    train: Any  # then train the optimized plan on the whole dataset (the panel's last step)
    budget: Any  # the time the diagnosis may take ("15m"; "" = its default)
    run: Any  # the Run button
    stop: Any  # the Stop button: ends the step running now
    progress: Any  # IntProgress over the diagnosis' steps
    status: Any  # Label: the step running, then the run folder or the error
    log: Any  # Output: tqdm's per-experiment bars
    outputs: dict[str, Any] = field(default_factory=dict)  # step name -> its Output widget
    folder: str = ""  # the run folder the last Run wrote
    settings: dict[str, Any] = field(default_factory=dict)  # other DiagnoseConfig fields, as given
    failed: dict[str, str] = field(default_factory=dict)  # step name -> its one-line error
    stop_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    interruptible: bool = False  # a step may be ended now (guarded by lock)
    sources: dict[str, Any] = field(default_factory=dict)  # other source flags (SourceConfig)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.box._repr_mimebundle_(**kwargs) or {})
        bundle["text/plain"] = NO_WIDGETS
        bundle["text/html"] = f"<p class=diag-no-widgets><b>diag</b>: {NO_WIDGETS}</p>"
        return bundle

    def wait(self, timeout: float | None = None) -> str:
        """Block until the Run in progress (if any) ends; the run folder it wrote, or ""."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.folder

    def draw(self, step: Any, frames: dict[str, pd.DataFrame]) -> None:
        """run_diagnose's on_result hook: count the step, draw its view."""
        self.progress.value = min(self.progress.value + 1, self.progress.max)
        self.status.value = f"done: {step.name}"
        view = VIEWS.get(step.field)
        if view is not None and step.name in self.outputs:
            self.outputs[step.name].outputs = tuple(_mime(item) for item in view(frames))

    def fail(self, step: Any, error: Exception) -> None:
        """run_diagnose's on_error hook: one redacted line in the step's view; the run goes on."""
        name = getattr(step, "name", step)
        self.progress.value = min(self.progress.value + 1, self.progress.max)
        line = _one_line(f"{name} failed", error)
        self.failed[name] = line
        if name in self.outputs:
            self.outputs[name].outputs = (_mime(line),)

    def clear(self, cfg: DiagnoseConfig) -> None:
        """Empty every output and size the progress bar for cfg's steps."""
        for widget in [self.log, *self.outputs.values()]:
            widget.outputs = ()
        self.progress.value, self.progress.max = 0, len(steps(cfg))
        self.failed, self.folder = {}, ""


# the text fields that are numbers, as their flags take them: (convert, what is allowed)
_NUMBERS = {"retries": (lambda v: int(v) if v else None,
                        "a whole number >= 0, or '' for your AWS config's"),
            "stall_s": (float, "a number of seconds > 0")}


def config_from(p: Panel) -> DiagnoseConfig:
    """The DiagnoseConfig the panel's fields describe (ValueError names a bad field)."""
    sources = {}  # the source widgets' values as SourceConfig fields
    for name, widget in p.sources.items():
        value = widget.value if isinstance(widget.value, bool) else widget.value.strip()
        if name in _NUMBERS:
            convert, allowed = _NUMBERS[name]
            try:
                value = convert(value)
            except ValueError:
                raise ValueError(f"{name}={value!r}: {allowed}") from None
        sources[name] = value
    return DiagnoseConfig.default(
        quick=p.quick.value, **p.settings, train=p.train.value, budget=p.budget.value.strip(),
        source=p.source.value.strip(), model=p.model.value.strip(), plan=p.plan.value,
        **sources, workers=parse_ints(p.workers.value, "num_workers"),
        micro_batches=parse_ints(p.micro_batches.value, "micro-batches"))


def _one_line(what: str, error: BaseException) -> str:
    return redact(f"{what}: {type(error).__name__}: {error}".splitlines()[0][:300])


def run_panel(p: Panel) -> None:
    """What Run does (in the calling thread): the diagnosis, each step's view drawn as it comes."""
    p.run.disabled, p.stop.disabled = True, False
    try:
        cfg = config_from(p)
        p.clear(cfg)
        with quiet(p.log):
            with p.lock:
                p.interruptible = True
            try:
                p.folder = str(run_diagnose(cfg, on_result=p.draw, stop=p.stop_event,
                                            on_error=p.fail))
            finally:
                with p.lock:
                    p.interruptible = False
        failed = f"; {len(p.failed)} step(s) failed: {', '.join(p.failed)}" if p.failed else ""
        p.status.value = redact(f"wrote {p.folder}{failed}")
    except Stopped:  # raised before a step, or into the step that was running
        p.status.value = (f"stopped after {p.progress.value} of {p.progress.max} steps; "
                          "the finished steps' views are kept, no run folder written")
    except Exception as error:  # one line in the panel, not raised into a button callback
        p.status.value = _one_line("failed", error)
    finally:
        p.run.disabled, p.stop.disabled = False, True
        p.stop_event.clear()


def start(p: Panel) -> None:
    """The Run button: run_panel in a thread, so the kernel still handles Stop meanwhile."""
    if p.thread is not None and p.thread.is_alive():
        return
    p.stop_event.clear()
    # in the click's context: the kernel routes a thread's output by the parent message kept
    # in context variables (a bare thread's is dropped); quiet(p.log) is set in that copy
    p.thread = threading.Thread(target=contextvars.copy_context().run, args=(run_panel, p),
                                name="diag-panel", daemon=True)
    p.thread.start()


def request_stop(p: Panel) -> None:
    """The Stop button: no further step starts; the running one gets an asynchronous Stopped."""
    p.stop_event.set()
    with p.lock:
        if p.interruptible and p.thread is not None and p.thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(p.thread.ident),
                                                       ctypes.py_object(Stopped))


def panel(source: str = "", model: str = "", workers: str = "", micro_batches: str = "",
          plan: str = "both", quick: bool | None = None, **settings: Any) -> Panel:
    """Build the panel (nothing runs until Run); settings: other DiagnoseConfig fields."""
    import ipywidgets as w

    if plan not in PLANS:
        raise ValueError(f"plan={plan!r}: allowed values are " + ", ".join(map(repr, PLANS)))
    wide, sources = w.Layout(width="60%"), {}
    for f in fields(SourceConfig):  # a widget per other source field, seeded from settings
        if f.name in ("source", "model"):
            continue
        value, label = settings.pop(f.name, f.default), f.name.replace("_", " ")
        sources[f.name] = (w.Checkbox(bool(value), description=label) if isinstance(
            f.default, bool) else w.Text("" if value is None else str(value), description=label))
    p = Panel(
        box=None,
        source=w.Text(source, description="data", placeholder="s3://bucket/key ('' = embedded)",
                      layout=wide),
        model=w.Text(model, description="model", placeholder="org/name or folder ('' = embedded)",
                     layout=wide),
        workers=w.Text(workers, description="num_workers", placeholder="e.g. 0,1,2,4"),
        micro_batches=w.Text(micro_batches, description="micro-batch", placeholder="e.g. 2,8,16"),
        plan=w.ToggleButtons(options=PLANS, value=plan, description="plan"),
        quick=w.Checkbox(quick_mode() if quick is None else quick,
                         description="quick (test-sized)"),
        train=w.Checkbox(settings.pop("train", False), description="then train (diag train)"),
        budget=w.Text(settings.pop("budget", ""), description="budget", placeholder="e.g. 15m"),
        run=w.Button(description="Run", button_style="primary", icon="play"),
        stop=w.Button(description="Stop", button_style="warning", icon="stop", disabled=True),
        progress=w.IntProgress(value=0, min=0, max=1, description="steps"),
        status=w.Label(""), log=w.Output(), sources=sources, settings=settings)
    p.clear(config_from(p))  # a bad setting fails here, not on a click
    p.outputs = {s.name: w.Output() for s in STEPS}
    p.run.on_click(lambda _button: start(p))
    p.stop.on_click(lambda _button: request_stop(p))
    sections = [w.VBox([w.HTML(f"<b>{name}</b>"), output]) for name, output in p.outputs.items()]
    p.box = w.VBox([p.source, p.model, w.Accordion([w.VBox(list(p.sources.values()))],
                                                   titles=("source options",)),
                    w.HBox([p.workers, p.micro_batches]), p.plan,
                    w.HBox([p.quick, p.train, p.budget]),
                    w.HBox([p.run, p.stop, p.progress, p.status]), p.log, *sections])
    return p
