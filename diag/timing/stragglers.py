"""Which rank the others wait for, and why: per-rank stages of a DDP run, read like amdahl's.

`per_rank(frame)` turns gathered StageTimer rows (`stage`, `seconds`, `step`, `rank`, `node`,
optionally `run`) into one row per rank: steps, data_wait, compute, comm_wait (seconds per step),
each rank's own work per step against the fastest rank's (`relative`, NVIDIA resiliency's relative
score) and its median step against its own best (`individual`). `findings(frame)` names the
straggler, the seconds the others spent waiting for it, the cause its numbers point at and the fix.
Imports no experiment.
"""

from __future__ import annotations

import pandas as pd

STRAGGLER_SHARE = 0.10  # a rank whose own work per step exceeds the others' median by this is named
DATA_CAUSE_SHARE = 0.5  # the straggler's extra data_wait at least
                        # this share of its extra work: its loader
WORK_STAGES = ("data_wait", "h2d", "compute", "other")  # a rank's own time; comm_wait
                                                        # is waiting for others
COLUMNS = ["run", "rank", "node", "steps", "data_wait_s", "h2d_s", "compute_s", "comm_wait_s",
           "other_s", "work_s", "relative", "individual"]
FINDING_COLUMNS = ["run", "rank", "node", "finding", "wait_per_step_s", "seconds_waited",
                   "evidence"]


def _steps(frame: pd.DataFrame) -> pd.DataFrame:
    """Step-level rows, one column per stage (seconds), indexed by run, rank, node, step."""
    missing = {"stage", "seconds", "step", "rank"} - set(frame.columns)
    if missing:
        raise ValueError(f"frame lacks column(s) {sorted(missing)}: expected StageTimer rows "
                         "(stage, seconds, step, rank[, node, run])")
    rows = frame[frame["step"].notna()].assign(
        run=frame["run"] if "run" in frame.columns else "",
        node=frame["node"] if "node" in frame.columns else 0)
    wide = rows.pivot_table(index=["run", "rank", "node", "step"], columns="stage",
                            values="seconds", aggfunc="sum", fill_value=0.0)
    for stage in (*WORK_STAGES, "comm_wait"):
        if stage not in wide.columns:
            wide[stage] = 0.0
    wide["work"] = wide[list(WORK_STAGES)].sum(axis=1)
    return wide


def per_rank(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, rank): stage seconds per step (means), relative and individual scores."""
    wide = _steps(frame)
    if wide.empty:
        return pd.DataFrame(columns=COLUMNS)
    wide = wide.assign(step_total=wide["work"] + wide["comm_wait"])
    keys = ["run", "rank", "node"]
    out = wide.groupby(level=keys).agg(
        steps=("work", "size"), data_wait_s=("data_wait", "mean"), h2d_s=("h2d", "mean"),
        compute_s=("compute", "mean"), comm_wait_s=("comm_wait", "mean"),
        other_s=("other", "mean"), work_s=("work", "mean"),
        median_step=("step_total", "median"), best_step=("step_total", "min")).reset_index()
    fastest = out.groupby("run")["work_s"].transform("min")
    out["relative"] = out["work_s"] / fastest.where(fastest > 0)
    out["individual"] = out["median_step"] / out["best_step"].where(out["best_step"] > 0)
    return out[COLUMNS].sort_values(["run", "rank"], ignore_index=True)


def findings(frame: pd.DataFrame, cores_per_node: int | None = None,
             workers_per_rank: int | None = None) -> pd.DataFrame:
    """The straggler of each run (if any): who, what the others waited, the cause, the fix."""
    table = per_rank(frame)
    wide = _steps(frame) if not table.empty else None
    rows = []
    for run, ranks in table.groupby("run", sort=False):
        if len(ranks) < 2:
            continue
        slow = ranks.loc[ranks["work_s"].idxmax()]
        others = ranks[ranks["rank"] != slow["rank"]]
        base = others["work_s"].median()
        extra = slow["work_s"] - base
        if base <= 0 or extra / base < STRAGGLER_SHARE:
            continue
        steps = int(slow["steps"])
        # what the others waited for it: their comm_wait beyond the straggler's own (the
        # all-reduce's cost every rank pays), per step medians: one preempted step moves no rank
        waits = wide.loc[run]["comm_wait"].groupby(level="rank").median()
        per_wait = max(float(waits.drop(slow["rank"]).median() - waits[slow["rank"]]), 0.0)
        waited = per_wait * float(others["steps"].sum())
        extra_data = slow["data_wait_s"] - others["data_wait_s"].median()
        per_step = wide.loc[run]["work"].unstack("step").idxmax()  # slowest rank per step
        moved = per_step.map(lambda key: key[0]).value_counts()
        where = (f"rank {int(slow['rank'])} was the slowest in {int(moved.get(slow['rank'], 0))} "
                 f"of {len(per_step)} steps")
        evidence = (f"rank {int(slow['rank'])} (node {int(slow['node'])}): data_wait "
                    f"{slow['data_wait_s']:.3g} s, compute {slow['compute_s']:.3g} s per step; "
                    f"other ranks median data_wait {others['data_wait_s'].median():.3g} s, "
                    f"compute {others['compute_s'].median():.3g} s per step; the others waited "
                    f"{per_wait:.3g} s per step for it (median comm_wait beyond its own "
                    f"{waits[slow['rank']]:.3g} s); {where}")
        if extra_data >= DATA_CAUSE_SHARE * extra:
            fix = "workers per rank = cores per rank, not per node"
            if cores_per_node:
                local = max(int((table["node"] == slow["node"]).sum()), 1)
                fix += (f" ({cores_per_node} cores / {local} ranks on node "
                        f"{int(slow['node'])} = {max(cores_per_node // local, 1)} per rank")
                fix += f", now {workers_per_rank})" if workers_per_rank is not None else ")"
            finding = (f"rank {int(slow['rank'])}'s loader is starved: it waits "
                       f"{extra_data:.3g} s per step more than the others for data and every "
                       f"rank waits for it at the all-reduce; fix: {fix}")
        else:
            finding = (f"rank {int(slow['rank'])} computes {extra:.3g} s per step longer than "
                       "the others; fix: check that rank's device (clocks, throttling, a shared "
                       "GPU) and that batches are even (pack or bucket by length)")
        rows.append({"run": run, "rank": int(slow["rank"]), "node": int(slow["node"]),
                     "finding": finding, "wait_per_step_s": per_wait, "seconds_waited": waited,
                     "evidence": f"{evidence}; over {steps} steps"})
    return pd.DataFrame(rows, columns=FINDING_COLUMNS)
