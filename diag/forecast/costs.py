"""The cost table: what one unit of a job costs under each plan, measured, on a named clock.

A measurement row: a plan paid `seconds` on `clock` for `count` units of a stage. `table(measured)`
makes costs per unit (the median over rounds, its interval, the samples); every figure a person
reads (a saving, the waterfall, the headline, the projection, the ETA) is `price(costs, counts)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from diag.noise import median_interval

# one round's (or one start's) measurement of a stage
MEASURED = ["plan", "round", "stage", "unit", "count", "seconds", "clock", "when", "evidence"]
# what one unit costs: the median over rounds and its distribution-free interval
COLUMNS = ["plan", "stage", "unit", "seconds", "low", "high", "samples", "clock", "when",
           "evidence"]
# what a unit is: a start of the job; a fetch of the whole source (a run that fetched the shards
# its records were in counts their share of it); a token slot trained in a warm-up or a steady
# step (padding runs too) or evaluated (forward only); an optimizer step; a checkpoint save; a
# source byte tokenized into the cache; a record read per start; a token tokenized in the loop
UNITS = ("start", "source", "warmup_slot", "slot", "eval_slot", "warmup_step", "step", "save",
         "byte", "record", "token")
STAGES = ("fetch_data", "load_model", "download", "preprocess", "setup", "warmup", "train",
          "checkpoint", "eval")
FORWARD_SHARE = 1 / 3  # an evaluated slot's cost over a trained one's: forward, no backward


def row(plan: str, stage: str, unit: str, seconds: float | None, count: float = 1.0, *,
        clock: str = "wall", when: str = "runs", rnd: int = 0, evidence: str = ""
        ) -> dict[str, Any]:
    """One measurement row (MEASURED)."""
    assert unit in UNITS and stage in STAGES, (stage, unit)
    return {"plan": plan, "round": rnd, "stage": stage, "unit": unit, "count": count,
            "seconds": seconds, "clock": clock, "when": when, "evidence": evidence}


def measured(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(list(rows), columns=MEASURED)


def table(rows: pd.DataFrame) -> pd.DataFrame:
    """Costs per unit (COLUMNS): the median over rounds of seconds / count and its interval."""
    keys = ["plan", "stage", "unit", "clock", "when"]
    out = []
    ok = rows[rows["seconds"].notna() & (rows["count"] > 0)]
    for key, part in ok.groupby(keys, sort=False):
        per = list(part["seconds"] / part["count"])
        mid, low, high = median_interval(per)
        said = "; ".join(dict.fromkeys(e for e in part["evidence"] if e))
        out.append(dict(zip(keys, key)) | {"seconds": mid, "low": low, "high": high,
                                           "samples": len(per), "evidence": said})
    return pd.DataFrame(out, columns=COLUMNS)


def with_eval(costs: pd.DataFrame) -> pd.DataFrame:
    """The table with an eval_slot row (FORWARD_SHARE of it) beside each train slot row."""
    slots = costs[(costs["stage"] == "train") & (costs["unit"] == "slot")]
    evals = slots.assign(stage="eval", unit="eval_slot",
                         **{c: slots[c] * FORWARD_SHARE for c in ("seconds", "low", "high")},
                         evidence=f"{FORWARD_SHARE:.2g} of a trained slot (forward only): "
                                  + slots["evidence"])
    return pd.concat([costs, evals], ignore_index=True)


def price(costs: pd.DataFrame, counts: Mapping[str, Mapping[str, float]] | Mapping[str, float],
          *, clock: str | None = None, when: str | None = None) -> pd.DataFrame:
    """Each plan's stages priced: cost x count summed over units (counts per unit or per plan)."""
    nested = any(isinstance(v, Mapping) for v in counts.values())
    part = costs
    for column, want in (("clock", clock), ("when", when)):
        part = part if want is None else part[part[column] == want]
    out = []
    for (plan, stage), rows in part.groupby(["plan", "stage"], sort=False):
        mine = counts.get(plan, counts) if nested else counts
        n = [float(mine.get(u, 0)) for u in rows["unit"]]
        said = "; ".join(f"{u} x {k:,.4g} ({e})" if e else f"{u} x {k:,.4g}"
                         for u, k, e in zip(rows["unit"], n, rows["evidence"]))
        out.append({"plan": plan, "stage": stage,
                    **{c: float(sum(s * k for s, k in zip(rows[c], n)))
                       for c in ("seconds", "low", "high")}, "evidence": said})
    return pd.DataFrame(out, columns=["plan", "stage", "seconds", "low", "high", "evidence"])


def total(priced: pd.DataFrame, plan: str, stages: Iterable[str] | None = None) -> float:
    """The plan's priced seconds over `stages` (None: all of them)."""
    mine = priced[priced["plan"] == plan]
    if stages is not None:
        mine = mine[mine["stage"].isin(list(stages))]
    return float(mine["seconds"].sum())
