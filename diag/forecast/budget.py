"""`diag run --budget 15m`: the diagnosis' time split among its steps, shown before the first.

Each step gets its floor (`FLOORS`, scaled to the job's sizes by `floors()`) plus a weighted part
of the rest (`WEIGHTS`); `share(step)` re-splits what is left when a step starts, so an overrun
takes from later steps, never from the total. A budget under the floors is refused before work.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from diag.config import STORAGE_PULLS, duration_s
from diag.forecast.eta import duration as clock
from diag.machine.device import driver_version
from diag.model_load import cache_dir_for, snapshot_folder, weight_files
from diag.model_load.experiment import MAX_REPEATS
from diag.model_load.source import hub_endpoint, reachable
from diag.runner import Step, say
from diag.storage import list_remote, parse_url, source_client
from diag.storage.sample import ranges, spread

if TYPE_CHECKING:
    from diag.config import DiagnoseConfig, ModelLoadConfig, QLoraConfig, StorageConfig

# --budget "": a one-off cloud check on a GPU box, the embedded diagnosis on a CPU box
GPU_DEFAULT, CPU_DEFAULT, QUICK_DEFAULT = "15m", "3m", "1m"

# The least each step takes in `diag run --quick` on the embedded model and data (docs/
# calibration.md); floors() adds the job's sizes. Keyed by Step.field.
FLOORS = {"info": 1.0, "storage": 4.0, "model_load": 20.0, "job": 3.0, "accum": 8.0,
          "checkpointing": 3.0, "loader": 4.0, "qlora": 6.0, "qlora_projection": 1.0,
          "loader_projected": 8.0, "runs": 6.0, "accum_advice": 0.0}
# How the rest is shared: storage sizes its sample to its share, the decisions their repeats
WEIGHTS = {"storage": 3.0, "model_load": 2.0, "job": 1.0, "accum": 1.0, "checkpointing": 1.0,
           "loader": 1.0, "qlora": 2.0, "loader_projected": 1.0, "runs": 1.0}
DECISIONS = ("accum", "checkpointing", "loader")  # the job's decisions: decide_budget_s
STEPPED = (*DECISIONS, "qlora", "runs")  # steps that time the job's training steps

# Assumed rates (a fast cloud box's: a floor is a least) for the bytes known before any work
HUB_BYTES_PER_S = 200e6  # a model file from the hub (one stream; hf_xet on a cloud box)
LOAD_BYTES_PER_S = 1e9  # a cached model read, quantized to 4-bit and placed on the device
PULL_BYTES_PER_S = 200e6  # one method's pull of an object or range from the object store


@dataclass(frozen=True)
class Sizes:
    """Sizes known before any work (0: unknown or embedded): the model's, the source's."""

    model_bytes: int = 0
    model_at: str = "cached"  # "hub": downloaded once to the cache first; "cached"; "local"
    source_bytes: int = 0
    piece_bytes: int = 0  # the storage probe's first piece: the median object, or one range
    said: str = ""


def floors(sizes: Sizes, cfg: DiagnoseConfig) -> dict[str, tuple[float, str]]:
    """Each step's floor (seconds, basis): FLOORS scaled to the job, plus its transfers."""
    store, load = cfg.storage_config(), cfg.model_load_config()
    rounds = store.warmup + store.repeats
    fresh = "fresh" in load.scenarios and sizes.model_at != "local" and not (
        load.estimate_fresh and sizes.model_at == "cached")
    fill = int(sizes.model_at == "hub")
    pulls = [(1 + rounds * (len(STORAGE_PULLS) + 1), sizes.piece_bytes)]
    pulls += [(2 * rounds, sizes.source_bytes)] if cfg.land else []  # a miss and a hit a round
    loads = {"model_load": load.warmup + load.repeats * len(load.scenarios)}
    if cfg.qlora:  # the steps on the job (without it, these fields are the toy's: no model)
        # one load per checkpointing setting the decisions share; the comparison one per plan
        loads |= {"accum": 1, "checkpointing": 2 - bool(cfg.accum),
                  "qlora": 2 if cfg.plan == "both" else 1}
    downloads = {"model_load": fill + load.repeats * fresh, "job": fill * (not cfg.model_load)}
    # beyond the embedded run's seq_len 128 and 32 records, a step's tokens and the inputs grow
    seq = (cfg.seq_len or 128) / 128 if cfg.qlora else 1.0
    recs = (cfg.records or 32) / 32 if cfg.qlora else 1.0
    grow = {s: (seq, f"x {seq:.3g} for seq_len {cfg.seq_len}") for s in STEPPED if seq > 1}
    grow |= {"job": (recs, f"x {recs:.3g} for {cfg.records} records")} if recs > 1 else {}
    out = {}
    for step, floor in FLOORS.items():
        scale, why = grow.get(step, (1.0, ""))
        parts = [(floor * (scale - 1), why)] if scale > 1 else []
        parts += [(n * nbytes / PULL_BYTES_PER_S, f"{n} pulls of {_bytes(nbytes)}")
                  for n, nbytes in pulls if step == "storage" and nbytes]
        if sizes.model_bytes:
            parts += [(n * sizes.model_bytes / rate, f"{n} {what}{'s' * (n > 1)} of "
                       f"{_bytes(sizes.model_bytes)}")
                      for n, rate, what in ((loads.get(step, 0), LOAD_BYTES_PER_S, "load"),
                                            (downloads.get(step, 0), HUB_BYTES_PER_S,
                                             "download")) if n]
        extra = sum(p for p, _ in parts)  # under a second: within what FLOORS measured
        out[step] = ((floor + extra, f"{floor:.0f} s + " + " + ".join(w for _, w in parts))
                     if extra >= 1 else (floor, ""))
    return out


def _bytes(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.3g} MB"


@dataclass
class Budget:
    """total_s split among steps (in the order they run); times each one through `timed`."""

    total_s: float
    steps: Sequence[Step]
    text: str = ""  # the budget as given ("15m")
    started: float = field(default_factory=time.perf_counter)
    spent: dict[str, float] = field(default_factory=dict)  # by Step.field, once it ran
    given: dict[str, float] = field(default_factory=dict)  # its share when it started
    ended: float = 0.0  # when the last step in the budget ended
    measures: Callable[[Step], str] = lambda step: step.name  # what it will measure, in counts
    decides: bool = False  # the job's decisions size their repeats to their shares
    floors: dict[str, tuple[float, str]] = field(default_factory=dict)  # floors(); {}: FLOORS
    sizes: str = ""  # what the floors were scaled from (Sizes.said)

    def __post_init__(self) -> None:
        need = sum(self.floor(s) for s in self.steps)
        if self.total_s < need:
            each = ", ".join(f"{s.name} {clock(self.floor(s))}" for s in self.steps
                             if self.floor(s))
            scaled = f"; {basis}" if (basis := self.basis()) else ""
            raise ValueError(f"DiagnoseConfig.budget={self.text or self.total_s!r}: too small "
                             f"for the steps enabled: at least {clock(need)} ({each}{scaled}); "
                             "raise --budget or turn steps off (--no-model-load, ...)")

    def floor(self, step: Step) -> float:
        """The least the step takes (FLOORS, scaled to the sizes when they were known)."""
        return self.floors.get(step.field, (FLOORS.get(step.field, 0.0), ""))[0]

    def basis(self) -> str:
        """What scaled floors rest on: the sizes, the rates assumed ("": no floor rose)."""
        if not any(self.floors.get(s.field, (0, ""))[1] for s in self.steps):
            return ""
        return (f"floors scaled from {self.sizes} at assumed rates: the hub "
                f"{HUB_BYTES_PER_S / 1e6:.0f} MB/s, a cached load {LOAD_BYTES_PER_S / 1e9:.0f} "
                f"GB/s, a pull {PULL_BYTES_PER_S / 1e6:.0f} MB/s")

    def estimate(self, step: Step) -> float:
        """The step's share of the whole budget, as planned before the first step."""
        return self._split(self.steps, self.total_s)[step.field]

    def share(self, step: Step) -> float:
        """The step's share now: what is left, split over it and the steps after it."""
        if step.field in self.given:
            return self.given[step.field]
        left = [s for s in self.steps if s.field not in self.spent]
        took = time.perf_counter() - self.started
        return self._split(left, max(0.0, self.total_s - took)).get(step.field, 0.0)

    def decide_s(self) -> float:
        """What the job's decisions may spend on repeats: their shares above their floors."""
        return sum(max(0.0, self.share(s) - self.floor(s)) for s in self.steps
                   if s.field in DECISIONS)

    def _split(self, steps: Sequence[Step], total: float) -> dict[str, float]:
        floors = {s.field: self.floor(s) for s in steps}
        weights = {s.field: WEIGHTS.get(s.field, 0.0) for s in steps}
        rest, weight = max(0.0, total - sum(floors.values())), sum(weights.values()) or 1.0
        return {f: floors[f] + rest * weights[f] / weight for f in floors}

    def timed(self, run: Callable[[Any, Step, Callable[[], Any]], Any]
              ) -> Callable[[Any, Step, Callable[[], Any]], Any]:
        """run, with each step's share fixed when it starts and its seconds kept."""

        def timed_run(d: Any, step: Step, make: Callable[[], Any]) -> Any:
            if step not in self.steps:  # outside the budget (--train): its own ETA
                return run(d, step, make)
            self.given[step.field] = self.share(step)
            start = time.perf_counter()
            try:
                return run(d, step, make)
            finally:
                self.ended = time.perf_counter()
                self.spent[step.field] = self.ended - start

        return timed_run

    def plan(self) -> pd.DataFrame:
        """Before the first step: each step, what it will measure, its estimated seconds."""
        return pd.DataFrame([{"step": s.name, "measures": self.measures(s),
                              "estimated_s": self.estimate(s), "floor_s": self.floor(s),
                              "floor": self.floors.get(s.field, (0, ""))[1]
                              or "as measured on the embedded tiny model and 8 MB",
                              "sized_to_share": s.field == "storage"
                              or (self.decides and s.field in DECISIONS)}
                             for s in self.steps])

    def frame(self) -> pd.DataFrame:
        """After the run: the plan, each step's share and spent seconds, and the whole run."""
        out = self.plan().assign(
            share_s=[self.given.get(s.field) for s in self.steps],
            spent_s=[self.spent.get(s.field) for s in self.steps])
        whole = {"step": "the whole diagnosis", "measures": f"budget {self.text}",
                 "estimated_s": self.total_s, "floor_s": sum(self.floor(s) for s in self.steps),
                 "floor": self.sizes, "sized_to_share": False, "share_s": self.total_s,
                 "spent_s": (self.ended or time.perf_counter()) - self.started}
        return pd.concat([out, pd.DataFrame([whole])], ignore_index=True)

    def say(self, spent: bool = False) -> None:
        """show() beside the progress bar (stderr: --json stays JSON; a kernel: its table)."""
        say(self.show(spent), self.frame() if spent else self.plan())

    def show(self, spent: bool = False) -> str:
        """The plan before the first step (spent: estimated vs spent after the last), as lines."""
        lines = [f"diag run: budget {self.text}, " + ("estimated vs spent:" if spent else
                                                       "the plan (estimated, what it measures):")]
        if (scaled := self.basis()) and not spent:  # what the floors rest on, before the steps
            lines.append(f"  {scaled}")
        for row in (self.frame() if spent else self.plan()).itertuples():
            est = clock(row.estimated_s)
            if spent and row.spent_s == row.spent_s and row.spent_s is not None:
                lines.append(f"  {row.step:<44} {est:>9} {clock(row.spent_s):>9}")
            elif not spent:
                basis = self.floors.get(self.steps[row.Index].field, (0, ""))[1]
                floor = f" (floor {clock(row.floor_s)}: {basis})" if basis else ""
                lines.append(f"  {row.step:<44} {est:>9}  {row.measures}{floor}")
        return "\n".join(lines)


def of_run(cfg: DiagnoseConfig, steps: Sequence[Step], job: QLoraConfig | None) -> Budget:
    """cfg's budget over the steps but --train's, refused under their floors."""
    # its default by the kind of box, asked without torch: refused before preflight imports it
    gpu = cfg.device == "cuda" or (cfg.device == "auto" and driver_version() is not None)
    text = cfg.budget or (QUICK_DEFAULT if cfg.quick_experiments else GPU_DEFAULT if gpu
                          else CPU_DEFAULT)
    what = functools.partial(measures, storage=cfg.storage_config(),
                             model_load=cfg.model_load_config(), job=job)
    seconds = duration_s(text)  # a malformed budget is refused before the sizes are asked
    known = sizes(cfg)
    return Budget(seconds, [s for s in steps if s.field != "train"], text, measures=what,
                  decides=job is not None, floors=floors(known, cfg), sizes=known.said)


def sizes(cfg: DiagnoseConfig) -> Sizes:
    """The model's and the source's bytes from their listings (0 where one cannot be asked)."""
    model, at, source, piece, said = 0, "cached", 0, 0, []
    if cfg.model and (cfg.model_load or cfg.qlora):
        folder = Path(cfg.model).expanduser()
        local = folder if folder.is_dir() else snapshot_folder(cache_dir_for(cfg), cfg.model,
                                                                cfg.revision)
        at = "local" if folder.is_dir() else "cached" if local else "hub"
        try:
            model = sum(p.stat().st_size for p in weight_files(local)) if local else _hub(cfg)
            said.append(f"the model's {_bytes(model)} ({at})")
        except Exception as err:  # noqa: BLE001  unknown: the floors stay as measured
            said.append(f"the model's size unknown ({type(err).__name__})")
    if cfg.source and cfg.storage:
        try:
            objects = list_remote(source_client(cfg), parse_url(cfg.source))
            source = sum(o.size for o in objects)
            piece = (ranges(objects[0]) if len(objects) == 1 else spread(objects))[0].size
            said.append(f"the source's {_bytes(source)} in {len(objects)} object(s)")
        except Exception as err:  # noqa: BLE001
            said.append(f"the source's size unknown ({type(err).__name__})")
    return Sizes(model, at, source, piece, " and ".join(said))


def _hub(cfg: DiagnoseConfig) -> int:
    """The bytes of the model's safetensors weights as the hub lists them (no download)."""
    from huggingface_hub import HfApi

    endpoint = hub_endpoint()
    reachable(endpoint)  # huggingface_hub retries an unreachable host for ~20 s
    info = HfApi(endpoint=endpoint).model_info(cfg.model, revision=cfg.revision or None,
                                               files_metadata=True, timeout=10)
    return sum(f.size or 0 for f in info.siblings or () if fnmatch(f.rfilename, "*.safetensors"))


def measures(step: Step, storage: StorageConfig | None, model_load: ModelLoadConfig | None,
             job: QLoraConfig | None) -> str:
    """What the step will measure, in counts: the plan's middle column."""
    texts = {
        "info": "the device facts and a CPU matmul probe",
        "storage": storage and f"a sample sized to this share, pulled "
                               f"{storage.warmup + storage.repeats}x by each method, the whole "
                               "pull extrapolated; read from local disk cold and warm"
                               + ("; land() of the whole dataset" if storage.land else ""),
        "model_load": model_load and f"{model_load.repeats} load(s) of each of "
                                     f"{', '.join(model_load.scenarios)}, up to {MAX_REPEATS} "
                                     "while fresh vs cached is unresolved",
        "job": job and f"the job's first {job.records} records fetched and tokenized",
        "accum": job and f"micro-batch points x {job.sweep_steps} timed steps on the job",
        "checkpointing": "checkpointing on vs off on the job's step",
        "loader": job and f"num_workers {job.sweep_workers} against the job's step",
        "qlora": job and f"{job.plan} plan(s), {job.rounds}+ rounds of {job.steps} steps on "
                         f"{job.records} records (more while the gap is unresolved)",
        "qlora_projection": "the whole job priced at the costs measured",
        "loader_projected": "the loader sweep against target_gpu's estimated step",
        "runs": "the toy loop, naive and optimized",
        "accum_advice": "arithmetic on the runs",
    }
    return str(texts.get(step.field) or step.name)
