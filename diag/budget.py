"""`diag run --budget 15m`: the diagnosis' time split among its steps, the plan shown before the
first step, and each step's estimate beside what it spent after the last.

`Budget(total_s, steps)` gives each step its floor (`FLOORS`) plus a weighted part of the rest
(`WEIGHTS`); `share(step)` re-splits what is left over the steps not yet run when a step
starts, so a step that overran takes from the later ones, never from the total. A budget under
the steps' floors is refused before any work. Steps that size their work to their share:
storage (the sample each method pulls) and the job's decisions (their repeats,
`QLoraConfig.decide_budget_s`); the others run what they run, their share is
their estimate, and `frame()` sets each beside what it spent (the run folder's budget.csv).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diag.config import duration_s

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import DiagnoseConfig, ModelLoadConfig, QLoraConfig, StorageConfig
    from diag.runner import Step

GPU_DEFAULT, CPU_DEFAULT, QUICK_DEFAULT = "15m", "3m", "1m"  # --budget "" on each kind of run

# The least each step takes: what it took in `diag run --quick` on a 2-core CPU box with the
# embedded tiny model and an 8 MB dataset, rounded up (defaults, not measured here; a larger
# model or dataset needs more, which the spent column then shows). Keyed by Step.field.
FLOORS = {"info": 1.0, "storage": 4.0, "model_load": 20.0, "job": 3.0, "accum": 8.0,
          "checkpointing": 3.0, "loader": 4.0, "qlora": 6.0, "qlora_projection": 1.0,
          "loader_projected": 8.0, "runs": 6.0, "accum_advice": 0.0}
# How the rest of the budget is shared: storage sizes its sample to its share; the job's
# decisions their repeats; the other steps' share is slack for a model or data larger than the
# floors assumed (a 7B model's loads and steps).
WEIGHTS = {"storage": 3.0, "model_load": 2.0, "job": 1.0, "accum": 1.0, "checkpointing": 1.0,
           "loader": 1.0, "qlora": 2.0, "loader_projected": 1.0, "runs": 1.0}
DECISIONS = ("accum", "checkpointing", "loader")  # the job's decisions: decide_budget_s


def default(quick: bool, device_type: str) -> str:
    """--budget "": a one-off cloud check on a GPU box, the embedded diagnosis on a CPU box."""
    return QUICK_DEFAULT if quick else GPU_DEFAULT if device_type == "cuda" else CPU_DEFAULT


def clock(value: float) -> str:
    """Seconds as a person reads them: 45 s, 3.5 min, 1.2 h."""
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.3g} min" if value < 7200 \
        else f"{value / 3600:.3g} h"


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

    def __post_init__(self) -> None:
        need = sum(FLOORS.get(s.field, 0.0) for s in self.steps)
        if self.total_s < need:
            floors = ", ".join(f"{s.name} {FLOORS[s.field]:.0f} s" for s in self.steps
                               if FLOORS.get(s.field))
            raise ValueError(f"DiagnoseConfig.budget={self.text or self.total_s!r}: too small "
                             f"for the steps enabled: at least {clock(need)} ({floors}); "
                             "raise --budget or turn steps off (--no-model-load, ...)")

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
        return sum(max(0.0, self.share(s) - FLOORS.get(s.field, 0.0)) for s in self.steps
                   if s.field in DECISIONS)

    @staticmethod
    def _split(steps: Sequence[Step], total: float) -> dict[str, float]:
        floors = {s.field: FLOORS.get(s.field, 0.0) for s in steps}
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
        import pandas as pd

        return pd.DataFrame([{"step": s.name, "measures": self.measures(s),
                              "estimated_s": self.estimate(s),
                              "sized_to_share": s.field == "storage"
                              or (self.decides and s.field in DECISIONS)}
                             for s in self.steps])

    def frame(self) -> pd.DataFrame:
        """After the run: the plan with each step's share when it started and its spent
        seconds; a last row for the whole run against the budget."""
        import pandas as pd

        out = self.plan().assign(
            share_s=[self.given.get(s.field) for s in self.steps],
            spent_s=[self.spent.get(s.field) for s in self.steps])
        whole = {"step": "the whole diagnosis", "measures": f"budget {self.text}",
                 "estimated_s": self.total_s, "sized_to_share": False, "share_s": self.total_s,
                 "spent_s": (self.ended or time.perf_counter()) - self.started}
        return pd.concat([out, pd.DataFrame([whole])], ignore_index=True)

    def say(self, spent: bool = False) -> None:
        """show() beside the progress bar: on stderr, as the bar (a --json result stays JSON)."""
        import sys

        from tqdm.auto import tqdm

        tqdm.write(self.show(spent), file=sys.stderr)

    def show(self, spent: bool = False) -> str:
        """The plan before the first step (spent: estimated vs spent after the last), as lines."""
        lines = [f"diag run: budget {self.text}, " + ("estimated vs spent:" if spent else
                                                       "the plan (estimated, what it measures):")]
        for row in (self.frame() if spent else self.plan()).itertuples():
            est = clock(row.estimated_s)
            if spent and row.spent_s == row.spent_s and row.spent_s is not None:
                lines.append(f"  {row.step:<44} {est:>9} {clock(row.spent_s):>9}")
            elif not spent:
                lines.append(f"  {row.step:<44} {est:>9}  {row.measures}")
        return "\n".join(lines)


def of_run(cfg: DiagnoseConfig, steps: Sequence[Step], job: QLoraConfig | None) -> Budget:
    """cfg's budget (its default when "") over the steps but --train's fine-tune (its own
    ETA); refused when under their floors."""
    from diag.machine.device import driver_version

    # its default by the kind of box, asked without torch: refused before preflight imports it
    gpu = cfg.device == "cuda" or (cfg.device == "auto" and driver_version() is not None)
    text = cfg.budget or default(cfg.quick_experiments, "cuda" if gpu else "cpu")
    what = functools.partial(measures, storage=cfg.storage_config(),
                             model_load=cfg.model_load_config(), job=job)
    return Budget(duration_s(text), [s for s in steps if s.field != "train"], text,
                  measures=what, decides=job is not None)


def measures(step: Step, storage: StorageConfig | None, model_load: ModelLoadConfig | None,
             job: QLoraConfig | None) -> str:
    """What the step will measure, in counts: the plan's middle column."""
    land = "; land() of the whole dataset (--land)" if storage and storage.land else ""
    from diag.model_load.experiment import MAX_REPEATS

    rounds = storage and storage.warmup + storage.repeats
    loads = model_load and ", ".join(model_load.scenarios)
    texts = {
        "info": "the device facts and a CPU matmul probe",
        "storage": f"a sample of whole objects sized to this share, pulled {rounds} times by "
                   "each method (all objects if they fit), the whole pull extrapolated; the "
                   f"sample read from local disk cold and warm{land}",
        "model_load": f"{model_load and model_load.repeats} load(s) each: {loads}, more (up to "
                      f"{MAX_REPEATS}) while fresh vs cached is unresolved and this share allows"
                      + (" (a model already cached: its fresh load estimated from one file)"
                         if model_load and model_load.estimate_fresh else ""),
        "job": job and f"the job's first {job.records} records fetched and tokenized, the "
                       "model cached",
        "accum": job and f"micro-batch points x {job.sweep_steps} timed step(s) on the job",
        "checkpointing": "checkpointing on vs off on the job's step",
        "loader": job and f"num_workers {job.sweep_workers} against the job's step",
        "qlora": job and f"{job.plan} plan(s) x {job.rounds} round(s) of {job.steps} steps on "
                         f"{job.records} records",
        "qlora_projection": "the whole job priced at the costs measured (no new measurement)",
        "loader_projected": "the loader sweep against target_gpu's estimated step",
        "runs": "the toy loop, naive and optimized",
        "accum_advice": "arithmetic on the runs (no new measurement)",
    }
    return str(texts.get(step.field) or step.name)
