"""`diag train`: the issue-30 goals side by side in one run (imports paid before timing).

First the QLoRA comparison `diag run` makes (both plans, the optimized one measured on the job's
step, 3 interleaved rounds) kept as a run folder with its whole-job projection; then `diag train
--results <that folder>` on a named subset of the embedded data (--records, default 2,000; one
epoch of --batch-size records per step; 1% held out) under each plan: the same records, seed,
learning rate schedule and steps. Prints:
- `train_eta_error` (goal <= 0.15): |measured - ETA| / ETA, the first ETA `python -m diag train`
  prints for the whole command (once the run's own steps have a pace) against its process timed
  start to end by an outside clock;
- `train_projection_error` (no goal): the same for the optimized run's projection before its
  first stage, priced from the comparison's costs (its 8 steps, at that moment's load);
- `train_eval_loss_parity` (<= 0.1): |optimized - naive| final eval loss over the naive plan's
  eval-loss drop, each plan's drop printed (goal >= 5% each);
- `train_resume_max_loss_diff` (<= 1e-5): a `python -m diag train` of the optimized run SIGKILLed
  three times (just after a checkpoint, while one is being written, mid-step), each time continued
  with --resume, against the uninterrupted run: every step's and eval's loss, no temp left;
- `train_steady_compute_share` (>= 0.9): compute over the optimized run's steady train loop
  (set-up, eval and checkpoints apart, as the TimingCallback bills them);
- naive / optimized wall per trained token;
and writes a run folder with both runs (stage shares; both eval curves against trained tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pandas as pd
import transformers  # noqa: F401  # imported before the clock, as a job's start

from diag import decision, report
from diag.config import QLoraConfig, TrainConfig
from diag.frames import frames_of
from diag.qlora import run_train
from diag.qlora.checkpoints import last_checkpoint
from diag.qlora.job import open_sources
from diag.qlora.measure import job_inputs, measure_on_job
from diag.qlora.experiment import compare, project_job


def comparison_folder(job: QLoraConfig, src, out: Path) -> Path:
    """The decisions measured on the job, the comparison they feed and its projection, as a
    run folder (what `diag run` writes)."""
    inputs = job_inputs(job, src)
    decided = measure_on_job(job, inputs)
    result = compare(job, decided, src)
    print(result.comparison["text"].iloc[0])
    projection = project_job(TrainConfig.of_job(job), job, result, inputs)
    frames = frames_of("qlora", result) | frames_of("qlora_projection", projection)
    frames.pop("advice", None)
    return report.write(frames | {"decisions": decision.frame(decided)}, out)


def argv(cfg: TrainConfig) -> list[str]:
    """The `python -m diag train` flags that make cfg."""
    flags = {"results": cfg.results, "records": cfg.records, "batch-size": cfg.batch_size,
             "lr": cfg.lr, "seq-len": cfg.seq_len, "lora-r": cfg.lora_r,
             "lora-alpha": cfg.lora_alpha, "eval-every": cfg.eval_every,
             "checkpoint-every": cfg.checkpoint_every, "out-dir": cfg.out_dir,
             "device": cfg.device, "plan": cfg.plan}
    return [sys.executable, "-m", "diag", "train", *(
        part for k, v in flags.items() for part in (f"--{k}", str(v)))]


KILLS = ("after a checkpoint", "mid-checkpoint-write", "mid-step")


def killed_then_resumed(cfg: TrainConfig) -> dict:
    """cfg run by the CLI and SIGKILLed at each of KILLS in turn, every run after the first a
    --resume of the last; the last (uninterrupted) resume's JSON result."""
    out = Path(cfg.out_dir)
    for i, how in enumerate(KILLS):
        proc = subprocess.Popen(argv(cfg) + ["--resume"] * (i > 0), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            print(f"killed {how}: {_kill(proc, out, how)}; resuming")
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
    done = subprocess.run(argv(cfg) + ["--resume", "--json"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    left = [p.name for p in out.iterdir() if ".tmp-" in p.name]
    assert not left, f"temporaries left in {out}: {left}"
    return json.loads(done.stdout)


def _kill(proc: subprocess.Popen, out: Path, how: str) -> str:
    """SIGKILL proc at `how` (KILLS) in its run; what was on disk as it died."""
    def step() -> int:
        return int(last.name.split("-")[1]) if (last := last_checkpoint(out)) else 0

    def writing() -> list[str]:  # a checkpoint's temporary folder (diag.files.temp_path)
        return [p.name for p in out.glob(".checkpoint-*.tmp-*")] if out.is_dir() else []

    begun, seen = step(), None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended ({proc.returncode}) before it was killed {how}")
        if how == "mid-checkpoint-write" and writing():
            break
        if how != "mid-checkpoint-write" and step() > begun:
            if how == "after a checkpoint":
                break
            seen = seen or time.monotonic()  # mid-step: a second past the checkpoint,
            if time.monotonic() - seen > 1.0 and not writing():  # no save under way
                break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return f"checkpoint-{step()} the last whole one, {writing() or 'no save'} under way"


def seconds_of(said: str) -> float:
    """A duration as diag.forecast.eta.duration writes it ("45 s", "3.5 min", "2 h 40 min")."""
    h, m, s = (re.search(rf"([\d.]+) {u}\b", said) for u in ("h", "min", "s"))
    return sum(float(x.group(1)) * k for x, k in ((h, 3600), (m, 60), (s, 1)) if x)


def cli_eta(cfg: TrainConfig) -> tuple[float, float]:
    """(the first ETA `python -m diag train` prints for the whole command, its wall seconds by an
    outside clock from the start of the process to its end)."""
    start = time.perf_counter()
    done = subprocess.run(argv(cfg), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    said = re.search(r"ETA (.+?) \(wall\) for the whole command", done.stderr + done.stdout)
    assert said, (done.stderr + done.stdout)[-2000:]
    return seconds_of(said.group(1)), wall


def measure(args: argparse.Namespace, work: Path, begin: float) -> int:
    # the comparison as `diag run` makes it (3 interleaved rounds: the median round's costs)
    job = QLoraConfig(records=8 * args.batch_size, steps=8, seq_len=args.seq_len, lr=args.lr,
                      lora_r=8, lora_alpha=16, rounds=3, sweep_workers=[0, 2], device="cpu")
    with open_sources(job) as src:
        folder = comparison_folder(job, src, work / "comparison")
        cfg = TrainConfig.of_job(job, records=args.records, batch_size=args.batch_size,
                                 results=str(folder), eval_every=25, checkpoint_every=25)
        runs = {plan: run_train(cfg.replace(plan=plan, out_dir=str(work / plan)), src=src)
                for plan in ("optimized", "naive")}
    rows = {plan: r.frame.iloc[0] for plan, r in runs.items()}
    o, n = rows["optimized"], rows["naive"]
    print(runs["optimized"].eta[["stage", "predicted_s", "measured_s", "error_share",
                                 "flagged"]].to_string(index=False))
    print(f"train_projection_error: {o['eta_error']:.3g} (projected {o['predicted_s']:.3g} s "
          f"before the run, measured {o['seconds']:.3g} s over {int(o['steps'])} optimizer steps; "
          f"its ETA {o['eta_s']:.3g} s for {o['command_s']:.3g} s) (no goal)")
    eta, wall = cli_eta(cfg.replace(plan="optimized", out_dir=str(work / "cli")))
    print(f"train_eta_error: {abs(wall - eta) / eta:.3g} (the first ETA of `python -m diag "
          f"train` {eta:.4g} s, its process {wall:.4g} s start to end by an outside clock, "
          f"load {os.getloadavg()[0]:.1f}) (goal <= 0.15)")
    drops = {p: (r["first_eval_loss"] - r["final_eval_loss"]) / r["first_eval_loss"]
             for p, r in rows.items()}
    parity = abs(o["final_eval_loss"] - n["final_eval_loss"]) / (
        n["first_eval_loss"] - n["final_eval_loss"])
    print(f"train_eval_loss_parity: {parity:.3g} (final eval loss naive "
          f"{n['final_eval_loss']:.4f}, optimized {o['final_eval_loss']:.4f}; drops naive "
          f"{drops['naive']:.1%}, optimized {drops['optimized']:.1%}, goal >= 5% each; "
          f"{int(o['records'])} training records, {int(o['eval_records'])} held out) "
          "(goal <= 0.1)")
    stages = runs["optimized"].stages
    spent = stages[stages["step"].isna()].groupby("stage")["seconds"].sum()
    compute = float(stages.loc[stages["stage"] == "compute", "seconds"].sum())
    print(f"train_steady_compute_share: {compute / spent['train']:.3g} (compute {compute:.3g} s "
          f"of the steady loop's {spent['train']:.3g} s; eval {spent.get('eval', 0):.3g} s and "
          f"checkpoint {spent.get('checkpoint', 0):.3g} s apart) (goal >= 0.9)")
    per = {p: r["seconds"] / r["trained_tokens"] for p, r in rows.items()}
    print(f"train_naive_over_optimized_per_token: {per['naive'] / per['optimized']:.3g} (naive "
          f"{n['seconds']:.3g} s, optimized {o['seconds']:.3g} s, {int(o['trained_tokens']):,} "
          "trained tokens each)")
    if not args.skip_resume:
        got = killed_then_resumed(cfg.replace(plan="optimized", out_dir=str(work / "killed")))
        resumed = {(r["split"], r["step"]): r["loss"] for r in got["train_losses"]}
        whole = runs["optimized"].losses.set_index(["split", "step"])["loss"].to_dict()
        assert resumed.keys() == whole.keys(), (sorted(resumed), sorted(whole))
        diff = max(abs(resumed[k] - whole[k]) for k in whole)
        print(f"train_resume_max_loss_diff: {diff:.3g} over {len(whole)} losses, killed "
              f"{', '.join(KILLS)}, last resumed from step {got['train'][0]['resumed_from_step']} "
              "(goal <= 1e-5)")
    both = {k: [frames_of("train", r)[k] for r in runs.values()]
            for k in ("train", "run", "train_losses", "train_eta")}
    out = report.write({k: pd.concat(v, ignore_index=True) for k, v in both.items()})
    print(f"wrote {out / 'report.html'} (both runs, both eval curves)")
    print(f"train_bench_seconds: {time.perf_counter() - begin:.0f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=2000, help="the named subset")
    parser.add_argument("--batch-size", type=int, default=8, help="records per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3, help="both plans' peak rate: the tiny "
                        "random model learns visibly in one epoch; at 4e-3 one seed's final eval "
                        "loss moved by more than the goal's tolerance from another's")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--skip-resume", action="store_true")
    args = parser.parse_args()
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diag-bench-train-") as tmp:  # the out-dirs
        return measure(args, Path(tmp), begin)


if __name__ == "__main__":
    sys.exit(main())
