"""Naive vs optimized QLoRA run on the same records, seed and schedule: where the time went.

`run_qlora(cfg)` runs the plans (cfg.plan) against the same sources and returns one row per plan
(end-to-end seconds, padding share, final loss), the stage rows, the loss curves, the shares
(diag.amdahl), each plan's settings with their evidence, and stage by stage the predicted vs the
measured saving (a prediction off by more than 25% is flagged, not hidden). What a start's fetch,
model folder and preprocess cost under each plan is timed before the runs (`time_starts`) where
no decision measured it, so every stage a fix changes is predicted; each plan's own step is
timed there too, the two interleaved until their medians settle (`time_steps`, CPU seconds on
a CPU): the step fixes' predictions start from the naive one and end at the optimized one, not
at a sweep's step a minute earlier. Each plan's 4-bit base is loaded (and that load timed)
once, by its step timed there, and reused by every round (diag.qlora.base.Bases).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diag.machine.device import on_cpu_threads
from diag.qlora.plans import Plan
from diag.qlora.predict import savings

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import QLoraConfig
    from diag.decision import Decision
    from diag.qlora.base import Bases
    from diag.qlora.job import Sources


@dataclass(frozen=True)
class QLoraResult:
    """What `run_qlora` returns (first field: the main table)."""

    frame: pd.DataFrame  # one row per plan: seconds end to end, tokens, padding, final loss
    stages: pd.DataFrame  # StageTimer rows of every plan (`run` = plan name)
    losses: pd.DataFrame  # run, step, loss, learning_rate
    shares: pd.DataFrame  # diag.amdahl.shares of the stages, per plan
    plans: pd.DataFrame  # run, setting, value, evidence
    savings: pd.DataFrame  # stage, predicted_s, measured_s, error_share, flagged, evidence
    advice: pd.DataFrame  # stage, finding, seconds_saved, evidence
    rounds: pd.DataFrame | None = None  # every plan x round summary (interleaved order)
    comparison: pd.DataFrame | None = None  # one row: per trained token, the spread, once_s
    mfu: pd.DataFrame | None = None  # per plan: MFU by executed and by model FLOPs (qlora.mfu)

    @property
    def headline(self) -> str:
        """naive vs optimized per trained token, with the spread; '' unless both plans ran."""
        return headline(self.frame) if set(self.frame["plan"]) >= {"naive", "optimized"} else ""


@on_cpu_threads
def run_qlora(cfg: QLoraConfig | None = None, decisions: Iterable[Decision] | None = None,
              src: Sources | None = None) -> QLoraResult:
    """Run cfg.plan ("naive", "optimized" or "both") cfg.rounds times, interleaved (the order
    alternates per round, so drift on a shared machine hits both alike). The optimized plan
    collects `decisions`; None: those cfg.results (a run folder) kept, else measured on the job
    (diag.qlora.measure). src: the job's sources, open (diag.qlora.job.open_sources); else
    they are opened here and closed at the end."""
    import pandas as pd
    from tqdm.auto import tqdm

    from diag.amdahl import shares
    from diag.config import QLoraConfig
    from diag.machine.device import resolve
    from diag.timing.distributed import init_group, root_first
    from diag.preflight import preflight
    from diag.qlora.checkpoints import claim
    from diag.qlora.base import Bases
    from diag.qlora.before import load_moved
    from diag.qlora.job import open_sources, prime, run_plan
    from diag.qlora.measure import plan_from_job, read_results
    from diag.qlora.mfu import count_plans, run_mfu
    from diag.qlora.predict import Counts, predict

    cfg = cfg or QLoraConfig.default()
    if decisions is None and cfg.results:  # checked before anything is measured or run
        decisions = read_results(cfg)
    preflight(cfg, job=cfg)  # folders, model, source and its first records: before any work
    if cfg.out_dir:  # another run's checkpoints there: refused unless --resume (same settings)
        claim(cfg.out_dir, cfg.identity(), cfg.resume, folders=("naive", "optimized"))
    init_group(resolve(cfg.device).type)  # under a launcher: join before the first barrier
    plans = []
    runs: list[dict[str, Any]] = []
    once: dict[str, float] = {}
    # one start of the embedded servers for the measurement and the runs
    with contextlib.nullcontext(src) if src else open_sources(cfg) as src:
        if cfg.plan in ("naive", "both"):
            plans.append(Plan.naive())
        if cfg.plan in ("optimized", "both"):
            plans.append(plan_from_job(cfg, decisions, src))  # measured on the job unless given
        # an optimized start finds the landed data, cached model and tokens: the first start
        # pays them once, apart from the per-start figure and shown beside it as once_s
        once = {}
        for p in plans:
            with root_first():  # under DDP rank 0 fills the node's caches, then the others hit
                once[p.name] = prime(cfg, p, src) if p.name == "optimized" else 0.0
        order = [(r, p) for r in range(cfg.rounds) for p in (plans if r % 2 == 0 else plans[::-1])]
        # each plan's base loaded once, by its own step timed before the rounds (both plans
        # run) or by its round 0, reused by the other rounds and the FLOP count
        with Bases() as bases:
            timed, own = _before_rounds(cfg, plans, src, bases)
            for r, plan in tqdm(order, desc="qlora plans x rounds", leave=False):
                got = run_plan(cfg, plan, src, bases)
                got["summary"]["round"] = r
                runs.append(got)
            counted = count_plans(cfg, plans, src, bases)  # each plan's step, counted untimed
    every = pd.DataFrame([r["summary"] for r in runs])
    frame = _per_plan(every, once)
    # the stage breakdown of each plan's median round (a real run, not a blend of rounds)
    keep = set(zip(frame["plan"], frame["median_round"]))
    kept = [r for r in runs if (r["summary"]["plan"], r["summary"]["round"]) in keep]
    stages = pd.concat([r["stages"] for r in kept], ignore_index=True)
    losses = pd.concat([r["losses"] for r in kept], ignore_index=True)
    table = shares(stages)
    plan_rows = pd.concat([p.frame() for p in plans], ignore_index=True)  # what ran
    saved = pd.DataFrame(columns=["stage", "finding", "predicted_s", "measured_s",
                                  "error_share", "flagged", "evidence"])
    if len(plans) == 2:
        slots = frame.set_index("plan")["token_slots"].astype(int).to_dict()
        counts = Counts(cfg.steps, cfg.warmup_steps, slots)  # counted, not timed
        naive_step, opt_step = own.get("naive"), own.get("optimized")
        # the step stages on the clock the naive step was timed on (CPU seconds on a CPU)
        cpu = bool(naive_step) and naive_step[3] == "cpu_s"
        saved = savings(_median_stages(runs, shares, cpu),
                        predict(plans[0], plans[1], counts, timed, naive_step and naive_step[:2],
                                opt_step and opt_step[:2]))
        if naive_step:
            saved = load_moved(saved, runs, naive_step[2], cpu)
        saved.loc[saved["stage"] == "load_model", "evidence"] += (
            "; measured: the part the fix sets, each plan's model folder (a download, or the "
            "cache) as its base first loaded (one load per plan, every round reuses it); the "
            "load itself, the same work in both plans, left out")
    advice = saved.rename(columns={"measured_s": "seconds_saved"})[
        ["stage", "finding", "seconds_saved", "evidence"]]
    both = {"naive", "optimized"} <= set(frame["plan"])
    return QLoraResult(frame, stages, losses, table, plan_rows, saved, advice, every,
                       compare(frame) if both else None, run_mfu(frame, stages, counted))


def _before_rounds(cfg: QLoraConfig, plans: list[Plan], src: Sources, bases: Bases
                   ) -> tuple[tuple[Decision, ...], dict[str, tuple[float, str, list[float], str]]]:
    """time_starts and each plan's own step (both plans run: the predictions' figures, each on
    the base `bases` keeps for its rounds), then what a start imports (the Trainer's module,
    peft, bitsandbytes: seconds) paid before the rounds: in a process of its own each plan's
    start pays them alike, here the first alone would, and its set-up and load would not be the
    plan's. The measurements' models (reference cycles) are collected here, not by a start."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from diag.qlora.before import time_starts, time_steps
    from diag.qlora.trainer import trainer_class

    both = len(plans) == 2
    timed = time_starts(cfg, plans, src) if both else ()
    # a process's first load builds transformers' table of checkpoint renames (0.1-0.5 s on 2
    # CPUs): each plan's first load is the one its rounds reuse, and the first paid it alone
    get_checkpoint_conversion_mapping("llama")
    own = time_steps(cfg, plans, src, bases) if both else {}
    trainer_class()
    gc.collect()
    return timed, own


def _per_plan(every: pd.DataFrame, once: dict[str, float]) -> pd.DataFrame:
    """One row per plan: the median round's summary, with the spread over rounds beside it."""
    import pandas as pd

    rows = []
    for plan, runs in every.groupby("plan", sort=False):
        ranked = runs.sort_values("seconds", kind="stable")
        mid = ranked.iloc[(len(ranked) - 1) // 2]  # the lower median: a round that ran
        # `seconds` is the median round's own (for an even count the lower median), so the
        # stage breakdown shown adds up to it
        rows.append(mid.to_dict() | {
            "seconds": float(mid["seconds"]), "seconds_min": float(runs["seconds"].min()),
            "seconds_max": float(runs["seconds"].max()), "rounds": len(runs),
            "median_round": int(mid["round"]), "once_s": once.get(plan, 0.0),
            "trained_tokens_per_s": float(mid["real_tokens"] / mid["seconds"])})
    return pd.DataFrame(rows).drop(columns=["round"])


def _median_stages(runs: list[dict[str, Any]], shares: Any, cpu: bool = False
                   ) -> pd.DataFrame:
    """Each plan's run-level seconds per stage, the median over rounds (measured side of the
    prediction check; one noisy round cannot swing it); load_model: the part of it a fix sets,
    its model folder (Bases' `folder_s`: a download, or the cache), not the load, the same work
    in both plans; cpu: warmup and train in the process's CPU seconds of those steps (the
    TimingCallback's), the clock they were predicted on."""
    import pandas as pd

    tables = [shares(r["stages"]).assign(round=r["summary"]["round"]) for r in runs]
    both = pd.concat(tables, ignore_index=True)
    both["stage"] = both["stage"].where(both["level"] == "run", "train")
    per = both.groupby(["run", "round", "stage"])["seconds"].sum().reset_index()
    fields = {"load_model": "model_folder_s"} | (
        {"warmup": "warmup_cpu_s", "train": "train_cpu_s"} if cpu else {})
    got = {(r["summary"]["plan"], r["summary"]["round"], stage): r["summary"].get(field)
           for r in runs for stage, field in fields.items()}
    keys = zip(per["run"], per["round"], per["stage"])
    per["seconds"] = [s if got.get(k) is None else got[k] for k, s in zip(keys, per["seconds"])]
    per["clock"] = per["stage"].map(lambda s: "CPU" if cpu and s in ("warmup", "train")
                                    else "wall")
    med = per.groupby(["run", "stage", "clock"])["seconds"].median().reset_index()
    return med.assign(level="run")


def compare(frame: pd.DataFrame) -> pd.DataFrame:
    """One row: naive over optimized seconds per trained token (median round, and the range
    the rounds' spreads allow), both trained-token counts, the optimized one-time cost."""
    import pandas as pd

    rows = frame.set_index("plan")
    n, o = rows.loc["naive"], rows.loc["optimized"]
    per = {k: {p: r[k] / r["real_tokens"] for p, r in (("naive", n), ("optimized", o))}
           for k in ("seconds", "seconds_min", "seconds_max")}
    return pd.DataFrame([{
        "naive_over_optimized_per_token": per["seconds"]["naive"] / per["seconds"]["optimized"],
        "low": per["seconds_min"]["naive"] / per["seconds_max"]["optimized"],
        "high": per["seconds_max"]["naive"] / per["seconds_min"]["optimized"],
        # one round has no spread: nothing says the gap would hold on a second run
        "resolved": bool(n["rounds"] > 1 and
                         per["seconds_min"]["naive"] > per["seconds_max"]["optimized"]),
        "rounds": int(n["rounds"]), "naive_trained_tokens": int(n["real_tokens"]),
        "optimized_trained_tokens": int(o["real_tokens"]), "optimized_per_start_s": o["seconds"],
        "optimized_once_s": o["once_s"], "optimized_check_s": o["check_s"]}])


def headline(frame: pd.DataFrame) -> str:
    """naive / optimized per trained token, median and the spread's ends, with both counts."""
    rows = frame.set_index("plan")
    n, o = rows.loc["naive"], rows.loc["optimized"]
    per = {p: r["seconds"] / r["real_tokens"] for p, r in (("naive", n), ("optimized", o))}
    low = (n["seconds_min"] / n["real_tokens"]) / (o["seconds_max"] / o["real_tokens"])
    high = (n["seconds_max"] / n["real_tokens"]) / (o["seconds_min"] / o["real_tokens"])
    resolved = n["seconds_min"] / n["real_tokens"] > o["seconds_max"] / o["real_tokens"]
    spread = (f"range {low:.3g}x-{high:.3g}x over {int(n['rounds'])} interleaved rounds"
              f"{'' if resolved else ', spreads overlap: not resolved'}" if n["rounds"] > 1 else
              "one round, no spread: --rounds 3 says whether the gap holds")
    return (f"optimized {per['naive'] / per['optimized']:.3g}x faster per trained token "
            f"({spread}); trained tokens naive "
            f"{int(n['real_tokens'])}, optimized {int(o['real_tokens'])}; optimized once "
            f"{o['once_s']:.3g} s (land, cache, token cache) + check_records {o['check_s']:.3g} s "
            f"beside {o['seconds']:.3g} s per start")
