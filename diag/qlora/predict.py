"""What each fix should save, stated before the run from the plans' decisions, then checked.

`predict(naive, optimized, counts, timed)` is a pure function of the two plans, their decisions
(diag.decision: `baseline_s` / `chosen_s` per "start" or per "step" in a stage), the job's
counts (steps, warm-up steps, token slots per plan) and `timed`: per-start worth the job timed
itself before its runs (diag.qlora.before.time_starts), for the settings whose decision has
none. No frame of the run is read, so measured seconds cannot leak into a prediction. A fix is
listed only where the plans differ in its setting, its text built from what changed
("num_workers 0 -> 2"); the stages no setting changes (UNCHANGED: the Trainer's set-up, the
checkpoint save) are predicted to save 0 s. `savings(table, predicted)` sets each run-level
stage's predicted saving beside the measured one (naive minus optimized); a miss over
PREDICTION_TOLERANCE of the prediction and over PREDICTION_FLOOR_S is flagged, both ways.

Step fixes are chained in step space so they add up: the naive step (the naive plan's own step
timed on the job just before the runs, where run_qlora timed it; else the accum decision's
baseline, scaled from the tokens per step it was timed at, `MeasuredOn.tokens_per_step`, to the
naive plan's, and by the checkpointing decision's `naive_ratio` when the naive plan
checkpoints; a ratio below 1, checkpointing making a step faster, is refused: nothing in the
chain is priced) is scaled by each compute fix's ratio in turn (micro-batch: its `naive_ratio`
on the clock the sweep compared, else chosen/baseline; checkpointing; packing's token slots);
the data_wait fixes save their measured seconds per step. Per-step savings count once per
steady step (`train`) and once per warm-up step (`warmup`); per-start savings once
(`fetch_data`, `load_model`, `preprocess`). On a CPU the naive step is timed in CPU seconds and
run_qlora checks warmup and train in the runs' CPU seconds (`clock` "CPU"): a shared box's load
moves a step's wall seconds 1.5-5x within a minute, which no figure taken before the runs can
foresee, and its CPU seconds a few percent; the per-start stages and a GPU's are wall seconds.
Where the runs met another naive step than the one timed (resolved: its CPU seconds drift too,
10-30% over minutes), run_qlora restates the step stages' predictions at the runs' speed
(diag.qlora.before.load_moved).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diag.decision import FIXES, PREDICTION_FLOOR_S, PREDICTION_TOLERANCE, by_setting

if TYPE_CHECKING:
    import pandas as pd

    from diag.decision import Decision
    from diag.qlora.plans import Plan

RUN_STAGES = ("fetch_data", "load_model", "preprocess", "warmup", "train", "checkpoint")
COMPUTE_ORDER = ("micro_batch", "gradient_checkpointing")  # the chain's order (then packing)
COLUMNS = ["setting", "change", "finding", "stage", "predicted_s", "per_step_s", "evidence"]
TOGETHER = "the step fixes together, beyond their ratios one at a time"
# run-level stages no setting of a plan changes: each plan pays the same, a saving of 0 s
UNCHANGED = {"setup": "the Trainer's set-up (wrap, optimizer, data loader)",
             "checkpoint": "the checkpoint save (adapter, optimizer, scheduler, RNG, step)"}


@dataclass(frozen=True)
class Counts:
    """What the job does, counted before it runs (no seconds): steps and token slots."""

    steps: int
    warmup_steps: int = 1
    token_slots: Mapping[str, int] = field(default_factory=dict)  # by plan name

    def __post_init__(self) -> None:
        if self.steps < 1 or not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"Counts(steps={self.steps}, warmup_steps={self.warmup_steps}): "
                             "need steps >= 1 and 0 <= warmup_steps <= steps")


def _seconds(d: Any) -> tuple[float, float] | None:
    if d is None or d.baseline_s is None or d.chosen_s is None:
        return None
    if not (math.isfinite(d.baseline_s) and math.isfinite(d.chosen_s)):
        return None
    return float(d.baseline_s), float(d.chosen_s)


def _row(setting: str, naive: Any, opt: Any, stage: str, predicted: float | None,
         per_step: float | None, why: str) -> dict[str, Any]:
    return {"setting": setting, "change": f"{setting} {naive} -> {opt}",
            "finding": FIXES.get(setting, setting), "stage": stage, "predicted_s": predicted,
            "per_step_s": per_step, "evidence": why}


def _step_rows(setting: str, a: Any, b: Any, per_step: float | None, counts: Counts,
               why: str) -> list[dict[str, Any]]:
    """One row per step stage the fix touches: the steady steps (train) and the warm-up ones."""
    steady = counts.steps - counts.warmup_steps
    rows = []
    for stage, n in (("train", steady), ("warmup", counts.warmup_steps)):
        if n:
            total = per_step * n if per_step is not None else None
            rows.append(_row(setting, a, b, stage, total, per_step, f"{why}; x {n} steps"))
    return rows


def predict(naive: Plan, optimized: Plan, counts: Counts, timed: Iterable[Decision] = (),
            naive_step: tuple[float, str] | None = None,
            optimized_step: tuple[float, str] | None = None) -> pd.DataFrame:
    """Each fix the plans differ in: its run-level stage and predicted seconds saved (None where
    nothing prices it, said in `evidence`), from the decisions, counts and `timed` only (a
    per-start worth the job timed itself, used where the plan's decision has no seconds); then
    the UNCHANGED stages at 0 s. naive_step: (seconds, what was timed) of the naive plan's own
    step timed on the job before the runs (diag.qlora.before.time_steps), the chain's start in
    place of the sweep's step scaled to it. optimized_step: the optimized plan's own step timed
    alike: where the chain ends elsewhere (ratios measured one at a time, on the sweep's rows, do
    not compose exactly), a row of its own ("the fixes together") saves the difference."""
    import pandas as pd

    decided, own = by_setting(optimized.decisions), by_setting(timed)
    for setting, d in own.items():  # the job's own timing prices what a decision left unpriced
        if _seconds(decided.get(setting)) is None:
            decided[setting] = d
    a, b = naive.settings(), optimized.settings()
    changed = [s for s in FIXES if s in a and a[s] != b[s]]
    rows: list[dict[str, Any]] = []
    # the compute chain: the naive step, then each fix's ratio in turn
    step, ratio, refused = _naive_step(decided, naive, counts, naive_step)
    origin = f"the naive step {naive_step[0]:.3g} s ({naive_step[1]}); " if naive_step else ""
    for setting in COMPUTE_ORDER:
        if setting not in changed:
            continue
        d, got = decided.get(setting), _seconds(decided.get(setting))
        if got is None or step is None or got[0] <= 0:
            rows += _step_rows(setting, a[setting], b[setting], None, counts, _unpriced(
                d, refused or ("no measured naive step to scale" if got else "")))
            continue
        if setting == "gradient_checkpointing" and ratio:
            new = step / ratio
            why = (f"{d.source}: on/off {ratio:.3g} measured at the naive micro-batch "
                   f"{naive.micro_batch} ({d.basis}); the step {step:.3g} s -> {new:.3g} s")
        elif setting == "micro_batch" and d.naive_ratio:  # on the clock the sweep compared
            new = step / d.naive_ratio
            from diag.accum import step_clock  # the clock the decision compared on

            unit = step_clock(d.measured_on.device)[1]
            why = (f"{d.source}: micro-batch {d.baseline} over {b[setting]} "
                   f"{d.naive_ratio:.3g}x per step measured ({d.basis}) in "
                   f"{'CPU' if unit == 'CPU s' else 'wall'} seconds; "
                   f"the step {step:.3g} s -> {new:.3g} s")
        else:
            new = step * got[1] / got[0]
            why = (f"{d.source}: {got[1]:.3g} s / {got[0]:.3g} s per step measured "
                   f"({d.basis}) x the step {step:.3g} s -> {new:.3g} s")
        rows += _step_rows(setting, a[setting], b[setting], step - new, counts, origin + why)
        step, origin = new, ""
    end = step  # where the compute chain ends: the optimized step it predicts
    if "pipeline" in changed:
        slots = [counts.token_slots.get(p.name) for p in (naive, optimized)]
        rows += _pipeline(decided.get("pipeline"), own.get("pipeline"), (a, b), counts,
                          step, slots, refused, origin)
        end = step * slots[1] / slots[0] if step is not None and all(slots) else None
    if naive_step and optimized_step and end is not None and rows:
        rows += [r | {"change": "the step fixes together", "finding": TOGETHER}
                 for r in _step_rows("", "", "", end - optimized_step[0], counts, (
                     f"the optimized plan's own step {optimized_step[0]:.3g} s "
                     f"({optimized_step[1]}) against the {end:.3g} s the fixes' ratios chain "
                     "to from the naive step (measured one at a time on the sweep's rows, "
                     "they do not compose exactly)"))]
    for setting in changed:
        if setting in COMPUTE_ORDER or setting == "pipeline":
            continue
        d = decided.get(setting)
        if d is not None and d.per == "start":
            rows.append(_start_row(d, a, b))
        elif _seconds(d) is not None:
            base, chosen = _seconds(d)
            rows += _step_rows(setting, a[setting], b[setting], base - chosen, counts,
                               f"{d.source}: {d.stage} {base:.3g} -> {chosen:.3g} s per step "
                               f"({d.basis})")
        else:
            stage = {"fetch": "fetch_data", "model_cache": "load_model"}.get(setting, "train")
            rows.append(_row(setting, a[setting], b[setting], stage, None, None,
                             _unpriced(d)))
    if rows:  # the plans differ: what no setting changes is predicted too (to save nothing)
        rows += [{"setting": "", "change": "unchanged by the plans", "finding": what,
                  "stage": stage, "predicted_s": 0.0, "per_step_s": None,
                  "evidence": f"{what}: no setting of the plans changes it"}
                 for stage, what in UNCHANGED.items()]
    return pd.DataFrame(rows, columns=COLUMNS)


def _naive_step(decided: dict[str, Any], naive: Plan, counts: Counts,
                timed: tuple[float, str] | None = None
                ) -> tuple[float | None, float | None, str]:
    """(the naive step's seconds, checkpointing's on/off ratio it pays, why it is refused).

    `timed`, the naive plan's own step timed on the job just before the runs, is the step: its
    rows (padding, masks), its checkpointing and the machine's load as the runs meet it (a
    sweep a minute earlier on a shared box: its step 1.9x its CPU seconds, the runs' 4x).
    Else the micro-batch sweep times its steps with checkpointing off (its own measurement prices
    it): a naive step that checkpoints pays the on/off ratio measured on the job at the naive
    micro-batch, and turning it off divides it out again, so the chain ends exactly at the
    sweep's chosen point whatever order the fixes are taken in. A ratio below 1 (recomputing
    never makes a step faster: noise) prices no naive step."""
    ckpt = decided.get("gradient_checkpointing")
    ratio = ckpt.naive_ratio if ckpt is not None and naive.gradient_checkpointing else None
    if ratio is not None and ratio < 1:
        return None, ratio, (f"checkpointing's on/off ratio {ratio:.3g} < 1 at the naive "
                             "micro-batch (on faster than off cannot be; re-measure it): the "
                             "naive step is not priced")
    if timed is not None:
        return timed[0], ratio, ""
    anchor = _seconds(decided.get("micro_batch"))
    step = anchor[0] * _slots_scale(decided["micro_batch"], naive, counts) if anchor else None
    return (step * ratio if step is not None and ratio else step), ratio, ""


def _pipeline(d: Any, own: Any, ab: tuple[dict, dict], counts: Counts, step: float | None,
              slots: list[int | None], refused: str, origin: str = "") -> list[dict[str, Any]]:
    """Packing's rows: the step scaled by the token slots, the preprocess start (its decision's,
    else the job's own timing), the pipeline decision's data_wait per step."""
    a, b = ab
    if step is not None and all(slots):
        new = step * slots[1] / slots[0]
        rows = _step_rows("pipeline", a["pipeline"], b["pipeline"], step - new, counts,
                          f"{origin}packing: token slots {slots[1]} / {slots[0]} x the step "
                          f"{step:.3g} s -> {new:.3g} s")
    else:
        rows = _step_rows("pipeline", a["pipeline"], b["pipeline"], None, counts, _unpriced(
            None, refused or "no measured step or token slots to scale"))
    start = d if d is not None and d.per == "start" else own or d
    if _seconds(start) is not None and start.per == "start":
        rows.append(_start_row(start, a, b))
    else:  # the token cache's start-up cost: said unpredicted, never left out
        rows.append(_row("pipeline", a["pipeline"], b["pipeline"], "preprocess", None, None,
                         _unpriced(d, "no decision prices the preprocess start")))
    if _seconds(d) is not None and d.per != "start":
        base, chosen = _seconds(d)
        rows += _step_rows("pipeline", a["pipeline"], b["pipeline"], base - chosen, counts,
                           f"{d.source}: {d.stage} {base:.3g} -> {chosen:.3g} s per step")
    return rows


def _slots_scale(d: Any, naive: Plan, counts: Counts) -> float:
    """The naive step's token slots over those of the step the decision timed: the accum sweep
    runs the job's packed step, the naive plan pads."""
    measured, slots = d.measured_on.tokens_per_step, counts.token_slots.get(naive.name)
    if not measured or not slots:
        return 1.0
    return slots / counts.steps / float(measured)


def _unpriced(d: Any, extra: str = "") -> str:
    where = f"{d.setting} is {d.basis}: {d.why}" if d is not None else "no decision"
    return f"not predicted ({extra or 'no measured seconds'}); {where}"


def _start_row(d: Any, a: dict, b: dict) -> dict[str, Any]:
    got = _seconds(d)
    stage = d.stage if d.stage in RUN_STAGES else "preprocess"
    if got is None:
        return _row(d.setting, a[d.setting], b[d.setting], stage, None, None, _unpriced(d))
    return _row(d.setting, a[d.setting], b[d.setting], stage, got[0] - got[1], None,
                f"{d.source}: {d.stage} {got[0]:.3g} s -> {got[1]:.3g} s per start "
                f"({d.basis}{' on ' + d.measured_on.label() if d.measured_on.label() else ''})")


def measured_by_stage(table: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Run-level seconds per plan: {run: {stage: seconds}} from a shares/stage frame."""
    if "level" in table.columns:  # a shares frame: the step-level parts are inside `train`
        runs = table.assign(stage=table["stage"].where(table["level"] == "run", "train"))
    else:
        runs = table[table["step"].isna()]
    per = runs.groupby(["run", "stage"])["seconds"].sum()
    return {run: per[run].to_dict() for run in per.index.get_level_values(0).unique()}


def savings(table: pd.DataFrame, predicted: pd.DataFrame) -> pd.DataFrame:
    """Per run-level stage a fix touches: predicted vs measured saving (naive - optimized);
    flagged when |measured - predicted| > PREDICTION_TOLERANCE x |predicted|. `clock`: the
    table's for that stage where it has one ("CPU": the step stages on a CPU, see predict), else
    wall."""
    import pandas as pd

    cols = ["stage", "finding", "predicted_s", "measured_s", "error_share", "flagged", "clock",
            "evidence"]
    per = measured_by_stage(table)
    if not {"naive", "optimized"} <= set(per) or predicted.empty:
        return pd.DataFrame(columns=cols)
    naive, opt = per["naive"], per["optimized"]
    clocks = dict(zip(table["stage"], table["clock"])) if "clock" in table.columns else {}
    rows = []
    for stage, fixes in predicted.groupby("stage", sort=False):
        priced = fixes["predicted_s"].dropna()
        pred = float(priced.sum()) if not priced.empty else None
        measured = naive.get(stage, 0.0) - opt.get(stage, 0.0)
        clock = clocks.get(stage, "wall")
        unit = "CPU s" if clock == "CPU" else "s"
        rows.append(check(stage, "; ".join(dict.fromkeys(fixes["change"])), pred, measured,
                          f"naive {naive.get(stage, 0.0):.3g} {unit} -> optimized "
                          f"{opt.get(stage, 0.0):.3g} {unit}; predicted from "
                          + " | ".join(fixes["evidence"])) | {"clock": clock})
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values("measured_s", ascending=False, ignore_index=True)


def check(stage: str, finding: str, predicted: float | None, measured: float,
          evidence: str = "") -> dict[str, Any]:
    """One checked prediction: the error as a share of the prediction, flagged past tolerance;
    a prediction under PREDICTION_FLOOR_S / PREDICTION_TOLERANCE (0.2 s; a 0 s one too) is
    judged against that, so a miss under PREDICTION_FLOOR_S is never flagged."""
    err = None if predicted is None else abs(measured - predicted) / max(
        abs(predicted), PREDICTION_FLOOR_S / PREDICTION_TOLERANCE)
    return {"stage": stage, "finding": finding, "predicted_s": predicted, "measured_s": measured,
            "error_share": err,
            "flagged": bool(err is not None and err > PREDICTION_TOLERANCE), "evidence": evidence}
