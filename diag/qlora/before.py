"""What a naive vs optimized comparison times before its runs, for the predictions: what each
plan's start pays (`time_starts`: fetch, model folder, preprocess) and each plan's own optimizer
step on its own rows (`time_steps`, on the base its rounds reuse, interleaved; CPU seconds on a
CPU); after the runs, whether they met the naive step timed here (`load_moved`).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from diag.qlora.measure import QLoraStep

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import QLoraConfig
    from diag.decision import Decision
    from diag.qlora.base import Bases
    from diag.qlora.job import Sources
    from diag.qlora.plans import Plan


def time_starts(cfg: QLoraConfig, plans: list[Plan], src: Sources) -> tuple[Decision, ...]:
    """What a start of each plan pays in fetch_data, the model folder (a download, or the
    persistent cache) and preprocess, timed with the functions its runs call, min(cfg.rounds, 3)
    times interleaved: decisions (per start, medians) for predict's use where none measured
    them; the model folder by the first round alone (a download is the same bytes each start;
    timed_folder: the median of starts timed until it settles, while cheap).
    A setting whose decision has its seconds (storage's, model_load's in `diag run`) is
    not timed again: both sides take the optimized plan's copy (a hit), no second download. The
    model's load itself is the same in both plans: not timed."""
    import shutil

    from diag.decision import Decision, MeasuredOn
    from diag.files import scratch_folder
    from diag.qlora.data import build_dataset, job_records
    from diag.qlora.base import timed_folder
    from diag.qlora.job import fetch_data

    priced = {d.setting for d in plans[1].decisions
              if d.per == "start" and d.saving_s() is not None}
    rows = []
    for r in range(max(1, min(cfg.rounds, 3))):
        for plan in plans if r % 2 == 0 else plans[::-1]:
            work = scratch_folder(f"diag-qlora-time-{plan.name}")
            try:
                clock = time.perf_counter()
                path = fetch_data(plans[1] if "fetch" in priced else plan, src, work,
                                  cfg.records)[0]  # the shards the run's records are in
                fetched = time.perf_counter()
                # the model folder timed by round 0 alone: an empty cache's download is the same
                # bytes every start (a 7B model's ~13 GB), later rounds read the kept cache
                again = "model_cache" in priced or r > 0
                folder, folder_s = timed_folder(plans[1] if again else plan, src, work)
                recs = job_records(cfg, path, folder)  # the run's untimed check_records
                built = time.perf_counter()
                build_dataset(cfg, plan, recs, folder, path)
                rows.append({"plan": plan.name, "round": r, "fetch_data": fetched - clock,
                             "load_model": None if r else folder_s,
                             "preprocess": time.perf_counter() - built})
            finally:
                shutil.rmtree(work, ignore_errors=True)
    on = MeasuredOn(step=f"this job's start, timed {len(rows) // 2}x before its runs (the "
                         "model folder in its first, until settled)")
    out = []
    for setting, stage in (("fetch", "fetch_data"), ("model_cache", "load_model"),
                           ("pipeline", "preprocess")):
        if setting in priced:
            continue
        seconds = [statistics.median(r[stage] for r in rows if r["plan"] == p.name
                                     and r[stage] is not None) for p in plans]
        naive, opt = (getattr(p, setting) for p in plans)
        out.append(Decision.from_rows(
            setting, opt, f"{stage} per start: {naive} {seconds[0]:.3g} s, {opt} "
            f"{seconds[1]:.3g} s", rows, source="qlora", measured_on=on, baseline=naive,
            stage=stage, per="start", baseline_s=seconds[0], chosen_s=seconds[1]))
    return tuple(out)


class RowsStep(QLoraStep):
    """The job's step on one optimizer step of a plan's own rows (the naive plan's padding and
    masks), collated as the Trainer collates them, its checkpointing as the plan's."""

    def __init__(self, cfg: QLoraConfig, model_dir: Any, device: Any, plan: Plan,
                 rows: list[dict[str, Any]], model: Any = None) -> None:
        super().__init__(cfg, model_dir, device, plan.gradient_checkpointing, model)
        self._rows = rows

    def batches(self, micro_batch: int) -> contextlib.AbstractContextManager[Iterator[Any]]:
        from transformers import default_data_collator  # the Trainer's, given no tokenizer

        rows = self._rows
        return contextlib.nullcontext(itertools.cycle(
            [default_data_collator(rows[i:i + micro_batch])
             for i in range(0, len(rows), micro_batch)]))


def time_steps(cfg: QLoraConfig, plans: list[Plan], src: Sources, bases: Bases
               ) -> dict[str, tuple[float, str, list[float], str]]:
    """Each plan's own optimizer step on the job (its first step's rows, micro-batch x
    accumulation, checkpointing) on the base its rounds will reuse (`bases` loads it: this is
    its one load): one warm-up step and one timed through diag.accum's harness, then rounds
    of one step of each plan, interleaved (diag.accum.retime: a load that moves hits both), to
    cfg.sweep_steps each and on until each median is settled (diag.noise.unsettled: its 95%
    interval within SETTLED of it) or half of cfg.decide_budget_s is spent; on the device's clock
    (diag.accum.step_clock: CPU seconds on a CPU, whose wall seconds move with the load; else
    wall). By plan name: (median, what was timed and its spread, the samples, the clock's
    column); a plan whose step ran out of memory is left out. Timed just before the runs
    (`load_moved` says after them whether they met it): predict's naive and optimized steps."""
    import pandas as pd

    from diag.accum import retime, samples, step_clock, train_points
    from diag.noise import SETTLED, spread, unsettled
    from diag.qlora.data import build_dataset, job_records
    from diag.qlora.job import rank_device
    from diag.qlora.measure import job_inputs
    from diag.timing import StageTimer

    job = job_inputs(cfg, src)  # the landed data and the cached model: hits by now
    device = rank_device(cfg)[0]
    steps, frames, shapes = [], [], []
    try:
        for plan in plans:
            data = build_dataset(cfg, plan, job_records(cfg, job.data_path, job.model_dir),
                                 job.model_dir, job.data_path)
            n = data.micro_batch * data.grad_accum
            plan = plan.for_device(str(device))  # as run_plan keys its base
            folder, model, _ = bases.load(cfg, plan, src, device, StageTimer(trace=False))
            steps.append(RowsStep(cfg, folder, device, plan, [data.dataset[i] for i in range(n)],
                                  model))
            frames.append(train_points([steps[-1]], [(data.micro_batch, data.grad_accum)],
                                       repeats=1, warmup_steps=1,
                                       desc=f"the {plan.name} step").assign(step=len(frames)))
            shapes.append((data.micro_batch, data.grad_accum, plan.gradient_checkpointing))
        timed, _ = retime(steps, pd.concat(frames, ignore_index=True), unsettled,
                          budget_s=cfg.decide_budget_s / 2, at_least=cfg.sweep_steps)
    finally:
        bases.release()  # their adapters off: round 0 starts from a fresh one on each base
    column = step_clock(device.type)[0]
    got = {i: v for (i, _, _), v in samples(timed, column).items()}
    loose = unsettled(got)
    out = {}
    for i, (plan, (micro, accum, ckpt)) in enumerate(zip(plans, shapes)):
        if i not in got:
            continue
        settled = (f"its median within {SETTLED:.0%}" if i not in loose else
                   f"not settled within {SETTLED:.0%} by the budget")
        out[plan.name] = statistics.median(got[i]), (
            f"{'CPU' if column == 'cpu_s' else 'wall'} seconds, its own rows, micro-batch "
            f"{micro} x {accum}, checkpointing {'on' if ckpt else 'off'}, timed "
            f"{len(got[i])}x on the job before the runs, interleaved with the other plan's "
            f"({settled}), spread {spread(got[i]):.0%}"), got[i], column
    return out


def load_moved(saved: pd.DataFrame, runs: list[dict[str, Any]], timed: list[float],
               cpu: bool = False) -> pd.DataFrame:
    """The step stages' evidence says whether the naive steps the runs met (warm-up and steady,
    every round; cpu: per step, each round's warm-up and steady loop's CPU seconds, the clock
    `timed` is on) are the step timed before them (diag.noise). Resolved apart, the machine ran
    at another speed than before the runs (a shared box's CPU seconds move 10-30% over minutes
    with what its neighbours run; the Trainer may add to the step): the step stages' predictions
    are restated at the runs' speed, x the naive step the runs met over the one timed before
    (the naive runs set the scale alone; the fixes' share of the step is still the prediction's
    own, and the optimized runs are what checks it); within noise, they stand as predicted."""
    import pandas as pd

    from diag.noise import compare as apart
    from diag.qlora.predict import check

    met, steady = [], []  # every step the runs met; their steady ones, as `timed` is
    for run in (r for r in runs if r["summary"]["plan"] == "naive"):
        rows = run["stages"]
        if cpu:  # per step, the warm-up's and the steady loop's (read at their ends alone)
            warm, n = (rows["stage"] == "warmup").sum(), rows["step"].nunique()
            met += [run["summary"]["warmup_cpu_s"] / warm] if warm else []
            steady += [run["summary"]["train_cpu_s"] / n] if n else []
            continue
        met += list(rows.loc[rows["stage"] == "warmup", "seconds"])  # a row per warm-up step
        steady += list(rows[rows["step"].notna()].groupby("step")["seconds"].sum())
    met += steady
    if not met:
        return saved
    got, unit = apart(timed, met), "CPU s" if cpu else "s"
    # the speed the runs met from their steady steps alone (a first step's own costs apart),
    # as the steps timed before them were steady (their warm-up apart)
    scale = statistics.median(steady or met) / statistics.median(timed)
    line = (f"; the naive step the runs met {statistics.median(met):.3g} {unit} vs "
            f"{statistics.median(timed):.3g} {unit} timed before them: {got.describe()}"
            + (f": the runs met another step (the machine's speed moved, or the Trainer adds to "
               f"it): predicted at the runs' speed, x {scale:.3g}" if got.resolved else ""))
    out = saved.copy()
    for i in out.index[out["stage"].isin(["warmup", "train"])]:
        row, predicted = out.loc[i], out.at[i, "predicted_s"]
        evidence = row["evidence"] + line
        if got.resolved and pd.notna(predicted):
            evidence += f" (as predicted before them {predicted:.3g} {unit})"
            predicted *= scale
        checked = check(row["stage"], row["finding"], predicted, row["measured_s"], evidence)
        for key, value in checked.items():
            out.at[i, key] = value
    return out
