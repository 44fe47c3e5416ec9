"""The QLoRA job, naive vs optimized plan, side by side in one run (imports paid before timing).

The optimized plan is measured on the job itself first (diag.qlora.measure.plan_from_job: accum
sweep, loader sweep and checkpointing on vs off, all on the nf4 + LoRA step), as `diag qlora`
does; then both plans run interleaved over --rounds rounds (order alternating). Prints:
- `qlora_naive_over_optimized`: per trained token (both counts shown), median and range;
- `qlora_prediction_error` (goal <= 0.25): the worst |measured - predicted| / predicted over the
  run-level stages the fixes touch (predictions from the decisions only, diag.qlora.predict;
  on a CPU warmup and train in the step's CPU seconds, the per-start stages in wall);
  a step stage's says whether the naive step the runs met is the one timed before them;
- `qlora_mfu_vs_counter` (within 0.05 of 1.0): diag's executed FLOPs of one step against
  FlopCounterMode's count plus the 4-bit forward matmuls it cannot see;
- `qlora_data_wait_share` (< 2%), `qlora_callback_overhead` (< 1%: the TimingCallback's own
  hook seconds measured inside the real Trainer steps of the run), and last
  `qlora_compute_share` (>= 0.9) from an optimized-only run of --long-steps steps;
- `qlora_regret` (<= 1.05, resolution <= 0.05): the optimized plan's steady step per trained
  token (CPU seconds; the wall regret beside) over the best of a grid fixed in
  bench/qlora_regret.py, on this job, with an A/A check against the plan's own grid point; the
  resolution: the half-width of the 95% interval of the per-round plan/best ratio, over it;
- `qlora_vs_trl` (>= 1.0): trained tokens/s of the train loop of diag's optimized
  plan over TRL's SFTTrainer(packing=True), same model, records and settings (bench/qlora_trl.py).
- `qlora_decision_stability` (1.0): three quick plan decisions agree or say within noise, and a
  constructed 2x gap resolves (decision_stability).
main() is the list of goals, one call each. The machine is shared: figures move with its load;
rounds are interleaved so load hits all.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys
import time
from types import SimpleNamespace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformers  # noqa: F401  # imported before the clock, as a job's start

from diag.config import QLoraConfig
from diag.qlora import Plan, run_qlora
from diag.timing import callback as callback_module
from diag.qlora.job import Sources, run_plan
from diag.qlora.measure import plan_from_job
from qlora_trl import print_vs_trl


def step_seconds(stages) -> float:
    steps = stages[stages["step"].notna()]
    return float(steps.groupby("step")["seconds"].sum().median())


class CostedCallback(callback_module.TimingCallback):
    """The TimingCallback, with the seconds spent inside its own step hooks added up: its cost
    measured inside real Trainer steps (on CUDA the syncs it adds are in it too)."""

    spent = 0.0
    calls = 0

    def on_step_begin(self, *args, **kwargs):
        start = time.perf_counter()
        super().on_step_begin(*args, **kwargs)
        CostedCallback.spent += time.perf_counter() - start

    def on_step_end(self, *args, **kwargs):
        start = time.perf_counter()
        super().on_step_end(*args, **kwargs)
        CostedCallback.spent += time.perf_counter() - start
        CostedCallback.calls += 1


@contextlib.contextmanager
def fetch_heavy_sources(dataset_mb: float):
    """The ~420 MB model on the local hub and a ~dataset_mb dataset in the local S3."""
    from diag.embedded import HubServer, S3Server, embedded_dataset, ensure_assets
    from diag.secrets import register

    assets = ensure_assets(model="small")
    data = embedded_dataset(dataset_mb)
    with S3Server() as s3, HubServer(assets.hub_root) as hub:
        register(s3.secret_key)
        s3.upload(data, "qlora/big.jsonl")
        yield Sources(f"s3://{s3.bucket}/qlora/big.jsonl", s3.client(), assets.repo_id,
                      hub.endpoint)


def job_runs(cfg: QLoraConfig, optimized: Plan) -> Any:
    """run_qlora: naive vs optimized over cfg.rounds interleaved rounds, its tables printed."""
    result = run_qlora(cfg, optimized.decisions)
    print(result.frame.set_index("plan")[[
        "seconds", "seconds_min", "seconds_max", "once_s", "check_s", "micro_batch", "grad_accum",
        "num_workers", "pipeline", "token_slots", "real_tokens", "padding_share",
        "final_loss"]].to_string())
    print(result.savings[["stage", "finding", "predicted_s", "measured_s", "error_share",
                          "flagged"]].to_string())
    print(result.comparison["text"].iloc[0])
    return result


def naive_over_optimized(result: Any, cfg: QLoraConfig) -> None:
    rows = result.frame.set_index("plan")
    n, o = rows.loc["naive"], rows.loc["optimized"]
    ratio = (n["seconds"] / n["real_tokens"]) / (o["seconds"] / o["real_tokens"])
    print(f"qlora_naive_over_optimized: {ratio:.3g}x per trained token ({int(n['real_tokens'])} "
          f"vs {int(o['real_tokens'])} trained tokens, {cfg.steps} steps, {cfg.rounds} "
          f"interleaved rounds; naive {n['seconds_min']:.3g}-{n['seconds_max']:.3g} s, "
          f"optimized {o['seconds_min']:.3g}-{o['seconds_max']:.3g} s)")
    print(f"qlora_padding_share_naive: {n['padding_share']:.1%}")


def prediction_error(result: Any) -> None:
    checked = result.savings.dropna(subset=["predicted_s"])
    if checked.empty:
        print("qlora_prediction_error: n/a (no stage was predicted: no measured decision)")
        return
    worst = checked.loc[checked["error_share"].idxmax()]
    met = str(worst["evidence"]).partition("; the naive step the runs met ")[2]
    unit = "CPU s" if worst["clock"] == "CPU" else "s"
    print(f"qlora_prediction_error: {worst['error_share']:.3g} (worst of {len(checked)} "
          f"predicted stages: {worst['stage']}, predicted {worst['predicted_s']:.3g} {unit}, "
          f"measured {worst['measured_s']:.3g} {unit}"
          + (f"; the naive step the runs met {met}" if met else "") + ") (goal <= 0.25)")


def long_run(cfg: QLoraConfig, optimized: Plan, long_steps: int) -> Any:
    """The optimized plan alone over a run long enough for steady state to weigh, the same
    records per step as the job; its callback hooks timed inside the real steps."""
    per_step = cfg.records // cfg.steps
    callback_module.TimingCallback, plain = CostedCallback, callback_module.TimingCallback
    try:
        long = run_qlora(cfg.replace(plan="optimized", steps=long_steps, rounds=1,
                                     records=per_step * long_steps), optimized.decisions)
    finally:
        callback_module.TimingCallback = plain
    print(long.shares[["run", "stage", "seconds", "share"]].to_string(index=False))
    return long


def data_wait_and_callback(long: Any) -> None:
    steps = long.stages[long.stages["step"].notna()]
    wait = float(steps.loc[steps["stage"] == "data_wait", "seconds"].sum())
    step = step_seconds(long.stages)
    cost = CostedCallback.spent / max(CostedCallback.calls, 1)
    print(f"qlora_data_wait_share: {wait / steps['seconds'].sum():.2%} (goal < 2%)")
    print(f"qlora_callback_overhead: {cost / step:.4%} of a {step:.3g} s step "
          f"({cost * 1e6:.2f} us per step, {CostedCallback.calls} real Trainer steps) "
          "(goal < 1%)")


def fetch_heavy(cfg: QLoraConfig) -> None:
    from diag.qlora.job import prepare

    heavy = cfg.replace(records=32, steps=2, warmup_steps=1)
    with fetch_heavy_sources(200.0) as src:
        naive = run_plan(heavy, Plan.naive(), src)
        fast_plan = Plan.optimized()
        prepare(heavy, fast_plan, src)
        fast = run_plan(heavy, fast_plan, src)
    print(f"qlora_fetch_heavy_naive_over_optimized: "
          f"{naive['summary']['seconds'] / fast['summary']['seconds']:.3g}x "
          f"(naive {naive['summary']['seconds']:.3g} s, optimized "
          f"{fast['summary']['seconds']:.3g} s)")


def regret(cfg: QLoraConfig, optimized: Plan, budget_s: float) -> None:
    from diag.qlora.job import open_sources
    from qlora_regret import print_regret

    with open_sources(cfg) as src:  # the job the plan was measured on: the same cfg
        print_regret(cfg, optimized, src, budget_s)


def compute_share(long: Any, long_steps: int) -> None:
    opt = long.stages
    total = float(long.frame["seconds"].iloc[0])
    compute = float(opt.loc[opt["stage"] == "compute", "seconds"].sum())
    print(f"qlora_compute_share: {compute / total:.3g} (goal >= 0.9; optimized, "
          f"{long_steps} steps, {total:.3g} s end to end)")


def decision_stability(repeats: int = 3) -> str:
    """`qlora_decision_stability` (goal 1.0): `repeats` plan decisions measured on one
    `diag qlora --quick` job, in one run, must agree on each timed setting (micro_batch,
    gradient_checkpointing, num_workers, pipeline; the loader's knobs follow num_workers), or
    where two differ, one of them says within noise or names the other among its ties; and a
    constructed 2x gap (micro-batch 1's step run twice, each pass at half the loss: the same
    gradients, twice the compute) must resolve to micro-batch 2, not be called noise. The
    figure is the share of those checks that hold; the repeats' added seconds are printed."""
    from diag.qlora.measure import QLoraStep, accum_on_job, job_inputs, measure_on_job

    cfg = QLoraConfig.quick()
    job = job_inputs(cfg)
    runs, spent = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        runs.append({d.setting: d for d in measure_on_job(cfg, job)})
        spent.append((time.perf_counter() - start,
                      sum(d.repeats_s or 0.0 for d in runs[-1].values())))
    timed = ("micro_batch", "gradient_checkpointing", "num_workers", "pipeline")
    held = []
    for setting in timed:
        got = [run[setting] for run in runs]
        apart = [(a, b) for a, b in itertools.combinations(got, 2) if a.value != b.value]
        held.append(all(a.resolved is False or b.resolved is False or a.value in b.tied
                        or b.value in a.tied for a, b in apart))
        print(f"  {setting}: " + " | ".join(
            f"{d.value} ({ {True: 'resolved', False: 'within noise'}.get(d.resolved, d.basis)}, "
            f"{' + '.join(map(str, d.samples)) or 'no'} samples)" for d in got))

    class Slowed(QLoraStep):  # twice the compute at micro-batch 1, the same gradients
        def backward(self, batch, scale=1.0):
            passes = 2 if batch["input_ids"].shape[0] == 1 else 1
            for _ in range(passes):
                super().backward(batch, scale / passes)

    step = Slowed(cfg, job.model_dir, job.device)
    # the job's own micro-batch decision, on the slowed step
    (built,) = accum_on_job(cfg, job, [1, 2], on=SimpleNamespace(step=lambda: step)).decisions
    gap_s = built.repeats_s or 0.0
    held.append(built.value == 2 and bool(built.resolved))
    print(f"  constructed 2x at micro-batch 1: micro-batch {built.value}: {built.why}")
    return (f"qlora_decision_stability: {sum(held) / len(held):.3g} ({sum(held)} of {len(held)} "
            f"checks hold: {len(timed)} timed settings over {repeats} decisions on one quick "
            "job, and the constructed 2x gap; measuring took "
            + ", ".join(f"{t:.3g} s ({r:.2g} s of it repeats)" for t, r in spent)
            + f"; the 2x case {gap_s:.2g} s of repeats) (goal 1.0)")


def mfu_vs_counter(cfg: QLoraConfig) -> str:
    """`qlora_mfu_vs_counter`: diag's executed FLOPs of one QLoRA step of the job's model
    against FlopCounterMode's count of the same step plus bitsandbytes' 4-bit forward matmuls
    (a custom op the counter cannot see, counted from the Linear4bit shapes), checkpointing off
    and on; the one further from 1 is the figure. Model FLOPs (6N / 8N + attention) shown as a
    multiple of executed."""
    import os

    from diag.embedded import ensure_assets
    from diag.machine.device import resolve
    from diag.qlora.base import load_model
    from diag.mfu import count_step, qlora_shape

    ratios, said = [], []
    for ckpt in (False, True):
        plan = dataclasses.replace(Plan.naive(), gradient_checkpointing=ckpt)
        model = load_model(cfg, plan, ensure_assets().model_dir, resolve(cfg.device))
        model.train()
        counter, run = count_step(model, 2, cfg.seq_len, cfg.seed)
        ratios.append((counter + run.forward_4bit) / run.total)
        said.append(f"checkpointing {'on' if ckpt else 'off'}: {ratios[-1]:.4f} (executed "
                    f"{run.total:.4g} FLOPs per token, counter {counter:.4g} + 4-bit forward "
                    f"{run.forward_4bit:.4g}; model FLOPs "
                    f"{qlora_shape(model, cfg.seq_len).flops_per_token / run.total:.3g}x executed)")
    worst = max(ratios, key=lambda r: abs(r - 1))
    return (f"qlora_mfu_vs_counter: {worst:.4f} ({'; '.join(said)}; load average "
            f"{os.getloadavg()[0]:.2f}) (goal within 0.05 of 1.0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long-steps", type=int, default=48,
                        help="steps of the optimized-only run the shares are taken from")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--fetch-heavy", action="store_true")
    parser.add_argument("--regret", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="seconds the repeats of --regret's finalists and of --trl may take")
    args = parser.parse_args()
    cfg = QLoraConfig(records=args.records, steps=args.steps, seq_len=args.seq_len,
                      lora_r=8, lora_alpha=16, rounds=args.rounds, warmup_steps=1)
    start = time.perf_counter()
    optimized = plan_from_job(cfg)
    print(f"measured on the job in {time.perf_counter() - start:.3g} s; the optimized plan:")
    for setting, why in optimized.evidence:
        print(f"  {setting}: {why}")
    # the goals, one call each; those that share a run take its product
    result = job_runs(cfg, optimized)
    naive_over_optimized(result, cfg)
    prediction_error(result)
    print(mfu_vs_counter(cfg))
    long = long_run(cfg, optimized, args.long_steps)
    data_wait_and_callback(long)
    if args.trl:
        print_vs_trl(cfg, optimized, args.budget_s)
    if args.fetch_heavy:
        fetch_heavy(cfg)
    if args.regret:
        regret(cfg, optimized, args.budget_s)
    print(decision_stability())
    print(f"bench wall: {time.perf_counter() - start:.3g} s; load average "
          + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1 / 5 / 15 min)")
    compute_share(long, args.long_steps)  # last: the bench's goal line


if __name__ == "__main__":
    from qlora_lockstep import one_arena

    from diag.machine.device import cpu_threads

    one_arena()  # before any thread: the regret's lockstep rounds run Trainers in threads

    with cpu_threads():  # as every diag run_*: on a CPU, DIAG_CPU_THREADS (default 1)
        main()
