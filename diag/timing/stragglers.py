"""Which ranks the others wait for, and why. `per_rank(frame)`: each rank's median stage seconds
per step and nvidia-resiliency-ext's `relative` and `individual` scores (0-1, 1 best);
`findings(frame)` names a straggler rank or node, what the others waited for it, cause and fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

DATA_CAUSE_SHARE = 0.5  # extra data_wait at least this share of the extra work: its loader
WORK_STAGES = ("data_wait", "h2d", "compute", "other")  # its own time (comm_wait: the others')
COLUMNS = ["run", "rank", "node", "steps", "data_wait_s", "h2d_s", "compute_s", "comm_wait_s",
           "other_s", "work_s", "relative", "individual"]
FINDING_COLUMNS = ["run", "ranks", "node", "finding", "wait_per_step_s", "seconds_waited",
                   "evidence"]  # ranks: "1", or "4,5,6" when a node is named


@dataclass(frozen=True)
class Rule:
    """A straggler is slower than the others' median by `share` and `floor_s` in `most` steps."""

    share: float = 0.10  # slower than the others' median by this share of it ...
    floor_s: float = 0.005  # ... and by at least this (clock and scheduling noise on a 2-6 ms step)
    most: float = 0.75  # ... in at least this share of the optimizer steps

    def __post_init__(self) -> None:
        for name, low, high in (("share", 0, float("inf")), ("floor_s", 0, float("inf")),
                                ("most", 0.5, 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not low <= value <= high:
                raise ValueError(f"Rule.{name}={value!r}: must be a number in [{low:g}, {high:g}]")


def _steps(frame: pd.DataFrame) -> pd.DataFrame:
    """Step-level rows, one column per stage (seconds), indexed by run, rank, node, step."""
    missing = {"stage", "seconds", "step", "rank"} - set(frame.columns)
    if missing:
        raise ValueError(f"frame lacks column(s) {sorted(missing)}: expected StageTimer rows "
                         "(stage, seconds, step, rank[, node, run])")
    rows = frame[frame["step"].notna()].assign(run=frame.get("run", ""), node=frame.get("node", 0))
    wide = rows.pivot_table(index=["run", "rank", "node", "step"], columns="stage",
                            values="seconds", aggfunc="sum", fill_value=0.0)
    wide = wide.reindex(columns=sorted({*wide.columns, *WORK_STAGES, "comm_wait"}), fill_value=0.0)
    return wide.assign(work=wide[list(WORK_STAGES)].sum(axis=1))


def per_rank(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, rank): median seconds per step of each stage, and the two scores."""
    wide = _steps(frame)
    if wide.empty:
        return pd.DataFrame(columns=COLUMNS)
    wide = wide.assign(step_total=wide["work"] + wide["comm_wait"])
    medians = {f"{s}_s": (s, "median") for s in (*WORK_STAGES, "comm_wait", "work")}
    out = wide.groupby(level=["run", "rank", "node"]).agg(
        steps=("work", "size"), median_step=("step_total", "median"),
        best_step=("step_total", "min"), **medians).reset_index()
    fastest = out.groupby("run")["work_s"].transform("min")
    out["relative"] = fastest / out["work_s"].where(out["work_s"] > 0)
    out["individual"] = out["best_step"] / out["median_step"].where(out["median_step"] > 0)
    return out[COLUMNS].sort_values(["run", "rank"], ignore_index=True)


def findings(frame: pd.DataFrame, cores_per_node: int | None = None,
             workers_per_rank: int | None = None, rule: Rule | None = None) -> pd.DataFrame:
    """The stragglers of each run (if any): who, what the others waited, the cause, the fix."""
    rule = rule or Rule()
    wide = _steps(frame)
    rows = []
    for run, part in wide.groupby(level="run", sort=False):
        part = part.droplevel("run")
        nodes = part.index.to_frame(index=False).groupby("rank")["node"].first()
        if len(nodes) < 2:
            continue
        work = part["work"].droplevel("node").unstack("rank").dropna()
        # per step and rank: own work beyond the other ranks' median, and whether that is slow
        base = pd.DataFrame({r: work.drop(columns=r).median(axis=1) for r in work.columns})
        extra = work - base
        slow = extra.gt(base * rule.share) & extra.gt(rule.floor_s)
        named = [r for r in work.columns if slow[r].mean() >= rule.most]
        # several slow ranks on one node: the node is the straggler (its disk, its CPUs)
        for _, ranks in pd.Series(named, dtype=int).groupby(nodes.reindex(named).to_numpy()):
            rows.append(_finding(run, part, nodes, list(ranks), extra, slow, cores_per_node,
                                 workers_per_rank))
    return pd.DataFrame(rows, columns=FINDING_COLUMNS)


def _finding(run: str, part: pd.DataFrame, nodes: pd.Series, slow_ranks: list[int],
             extra: pd.DataFrame, slow: pd.DataFrame, cores_per_node: int | None,
             workers_per_rank: int | None) -> dict:
    wide = part.droplevel("node")
    comm = wide["comm_wait"].unstack("rank").reindex(extra.index)
    data = wide["data_wait"].unstack("rank").reindex(extra.index)
    others = [r for r in extra.columns if r not in slow_ranks]
    node = int(nodes[slow_ranks[0]])
    who = (f"rank {slow_ranks[0]}" if len(slow_ranks) == 1 else
           f"node {node} (ranks {', '.join(map(str, slow_ranks))})")
    # the others' comm_wait beyond the stragglers' own (what every rank pays a collective)
    paid = comm[slow_ranks].median(axis=1)
    beyond = comm[others].sub(paid, axis=0).clip(lower=0.0)
    per_wait = float(beyond.median(axis=1).median())
    waited = float(beyond.to_numpy().sum())
    more = float(extra[slow_ranks].median(axis=1).median())
    more_data = float((data[slow_ranks].median(axis=1) - data[others].median(axis=1)).median())
    often = int(slow[slow_ranks].all(axis=1).sum())
    evidence = (f"{who}: own work {more:.3g} s per step above the other ranks' median, slower "
                f"in {often} of {len(extra)} steps (median data_wait "
                f"{data[slow_ranks].median().median():.3g} s vs "
                f"{data[others].median().median():.3g} s); the others waited {per_wait:.3g} s "
                f"per step for it (median comm_wait beyond its own {paid.median():.3g} s), "
                f"{waited:.3g} s in all")
    if more_data >= DATA_CAUSE_SHARE * more:
        fix = "workers per rank = cores per rank, not per node"
        if cores_per_node:
            local = max(int((nodes == node).sum()), 1)
            fix += (f" ({cores_per_node} cores / {local} ranks on node {node} = "
                    f"{max(cores_per_node // local, 1)} per rank")
            fix += f", now {workers_per_rank})" if workers_per_rank is not None else ")"
        finding = (f"{who}'s loader is starved: it waits {more_data:.3g} s per step more than "
                   "the others for data and every rank waits for it at the next collective; "
                   f"fix: {fix}")
    else:
        finding = (f"{who} computes {more:.3g} s per step longer than the others; fix: check "
                   "that device (clocks, throttling, a shared GPU) and that batches are even "
                   "(pack or bucket by length)")
    return {"run": run, "ranks": ",".join(map(str, slow_ranks)), "node": node, "finding": finding,
            "wait_per_step_s": per_wait, "seconds_waited": waited, "evidence": evidence}
