"""What each plan costs, timed before the comparison's runs in interleaved rounds: its start
(`time_starts`) and its own optimizer step (`time_steps`), as cost rows on both clocks."""

from __future__ import annotations

import shutil
import time
from typing import TYPE_CHECKING, Any

from diag.forecast.costs import measured, row
from diag.qlora.measure import QLoraStep

if TYPE_CHECKING:
    import pandas as pd
    from diag.config import QLoraConfig
    from diag.qlora.base import Bases, Sources
    from diag.qlora.plans import Plan

STARTS = {"fetch": "fetch_data", "model_cache": "download", "pipeline": "preprocess"}


def time_starts(cfg: QLoraConfig, plans: list[Plan], src: Sources, clock: str) -> pd.DataFrame:
    """Each plan's start, min(cfg.rounds, 3) times; the model folder in the first round alone."""
    from diag.files import scratch_folder
    from diag.noise import interleave
    from diag.qlora.base import timed_folder
    from diag.qlora.data import build_dataset, job_records
    from diag.qlora.job import fetch_data

    # start settings the optimized plan's decisions price on this clock (diag run's): not re-timed
    known = {d.setting for d in plans[1].decisions if d.per == "start"
             and d.saving_s() is not None and (d.clock or "wall") == clock}

    def start(plan: Plan, rnd: int) -> list[dict[str, Any]]:
        work = scratch_folder(f"diag-qlora-time-{plan.name}")
        try:
            t, c = time.perf_counter(), time.process_time()
            path = fetch_data(plans[1] if "fetch" in known else plan, src, work, cfg.records)[0]
            spent = {"fetch_data": (time.perf_counter() - t, time.process_time() - c)}
            again = "model_cache" in known or rnd > 0  # later rounds: the kept cache
            folder, took = timed_folder(plans[1] if again else plan, src, work)
            if not again:
                spent["download"] = (took["wall"], took["CPU"])
            recs = job_records(cfg, path, folder)  # the run's untimed check_records
            t, c = time.perf_counter(), time.process_time()
            build_dataset(cfg, plan, recs, folder, path)
            spent["preprocess"] = (time.perf_counter() - t, time.process_time() - c)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        said = f"a {plan.name} start timed before the runs"
        return [row(plan.name, stage, "start", s, clock=k, when="before", rnd=rnd, evidence=said)
                for stage, pair in spent.items() if stage not in {STARTS[k] for k in known}
                for k, s in zip(("wall", "CPU"), pair)]

    n = max(1, min(cfg.rounds, 3))
    got, _ = interleave(range(len(plans)), lambda i, rnd: start(plans[i], rnd), min_rounds=n,
                        max_rounds=n)
    rows = [r for runs in got.values() for rs in runs for r in rs]
    for d in plans[1].decisions:  # what a decision priced: its two sides, per start
        if d.setting in known:
            rows += [row(p, STARTS[d.setting], "start", s, clock=clock, when="before",
                         evidence=f"the {d.source} decision's: {d.why}")
                     for p, s in (("naive", d.baseline_s), ("optimized", d.chosen_s))]
    return measured(rows)


def time_steps(cfg: QLoraConfig, plans: list[Plan], src: Sources, bases: Bases,
               device: Any) -> pd.DataFrame:
    """Each plan's own first optimizer step on the base its rounds reuse, in rounds until each
    median settles or half of cfg.decide_budget_s is spent."""
    import pandas as pd
    from diag.accum import retime, train_points
    from diag.noise import unsettled
    from diag.qlora.data import build_dataset, job_records
    from diag.qlora.measure import job_inputs
    from diag.timing import StageTimer

    job = job_inputs(cfg, src)  # the landed data and the cached model: hits by now
    steps, frames = [], []
    try:
        for plan in plans:
            data = build_dataset(cfg, plan, job_records(cfg, job.data_path, job.model_dir),
                                 job.model_dir, job.data_path)
            n = data.micro_batch * data.grad_accum
            plan = plan.for_device(str(device))  # as run_plan keys its base
            folder, model, _ = bases.load(cfg, plan, src, device, StageTimer(trace=False))
            steps.append(QLoraStep(cfg, folder, device, plan.gradient_checkpointing, model,
                                   rows=[data.dataset[i] for i in range(n)]))
            frames.append(train_points([steps[-1]], [(data.micro_batch, data.grad_accum)],
                                       repeats=1, warmup_steps=1,
                                       desc=f"the {plan.name} step").assign(step=len(frames)))
        timed, _ = retime(steps, pd.concat(frames, ignore_index=True), unsettled,
                          budget_s=cfg.decide_budget_s / 2, at_least=cfg.sweep_steps)
    finally:
        bases.release()  # their adapters off: round 0 starts from a fresh one on each base
    ok = timed[timed["status"] == "ok"]
    rows = []
    for i, plan in enumerate(plans):
        mine = ok[ok["step"] == i]
        said = (f"its own step (micro-batch {int(mine['micro_batch'].iloc[0])} x "
                f"{int(mine['grad_accum'].iloc[0])}) timed {len(mine)}x before the runs, "
                "interleaved with the other plan's") if len(mine) else ""
        for n, pair in enumerate(zip(mine["seconds_per_step"], mine["cpu_s"])):
            rows += [row(plan.name, stage, unit, s, clock=k, when="before", rnd=n, evidence=said)
                     for stage, unit in (("train", "step"), ("warmup", "warmup_step"))
                     for k, s in zip(("wall", "CPU"), pair)]
    return measured(rows)
