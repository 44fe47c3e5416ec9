"""What a person reads of `diag train` and of the whole-job projection, on constructed frames:
the run folder's train section (the run against its ETA, both loss curves) and `diag run`'s
headline with the projection labelled as one."""

from __future__ import annotations

import re

import pandas as pd

from diag import report
from tests.test_amdahl import constructed


def _losses(run: str, drop: float) -> pd.DataFrame:
    train = [{"split": "train", "step": s, "loss": 7.6 - drop * s / 4, "learning_rate": 2e-4}
             for s in range(1, 5)]
    evals = [{"split": "eval", "step": s, "loss": 7.7 - drop * s / 4, "learning_rate": None}
             for s in (0, 2, 4)]
    frame = pd.DataFrame(train + evals).assign(run=run)
    return frame.assign(trained_tokens=frame["step"] * 1000)


def test_a_train_folder_shows_the_run_against_its_eta_and_both_loss_curves(tmp_path):
    row = {"plan": "optimized", "records": 1980, "eval_records": 20, "epochs": 1.0, "steps": 4,
           "trained_tokens": 4000, "seconds": 330.0, "predicted_s": 300.0,
           "first_eval_loss": 7.7, "final_eval_loss": 6.9, "out_dir": "/data/adapter",
           "eta_s": 320.0, "command_s": 352.0}
    eta = pd.DataFrame([{"stage": "train", "finding": "predicted before the run",
                         "predicted_s": 280.0, "measured_s": 300.0, "error_share": 0.07,
                         "flagged": False, "evidence": "token x 4,000"}])
    stages = constructed("optimized")
    stages["rank"] = 0
    losses = pd.concat([_losses("naive", 0.8), _losses("optimized", 0.7)], ignore_index=True)
    folder = report.write({"train": pd.DataFrame([row]), "run": stages, "train_losses": losses,
                           "train_eta": eta}, tmp_path / "run")
    text = (folder / "report.html").read_text()
    found = re.search(r"<section class=experiment id=train>(.*?)</section>", text, re.S)
    assert found, "no train section"
    said = found.group(1)
    assert "<h2>The fine-tune: the whole dataset under one plan" in said
    assert ("The optimized plan trained 1,980 records (20 held out) for 1.00 epoch, 4 steps, "
            "4,000 tokens, in <b>5.50\u00a0min</b>; 5.00\u00a0min projected before the run "
            "(+10%); the whole command 5.87\u00a0min against its ETA of 5.33\u00a0min, said once "
            "its first steps had a pace (+10%); held-out loss 7.70 &rarr; <b>6.90</b>; the "
            "adapter is in /data/adapter.") in said
    assert re.search(r'<img alt="train_losses" src="data:image/png;base64,', said)
    assert 'href="train_eta.csv"' in said and 'href="train_losses.csv"' in said
    assert (folder / "train_losses.png").stat().st_size > 1000


def test_the_headline_adds_the_whole_job_projected_for_each_plan():
    stages = pd.DataFrame([{"run": "naive", "stage": "train", "seconds": 40.0, "share": 1.0},
                           {"run": "optimized", "stage": "train", "seconds": 10.0, "share": 1.0}])
    found = pd.DataFrame(columns=["run", "stage"])
    projection = pd.DataFrame([
        {"plan": "naive", "stage": "total", "seconds": 39_600.0,
         "evidence": "30,318 records, 1 epoch"},
        {"plan": "naive", "stage": "train", "seconds": 39_000.0, "evidence": "x"},
        {"plan": "optimized", "stage": "total", "seconds": 9_600.0,
         "evidence": "30,318 records, 1 epoch"}])
    head = report.headline(stages, found, projection=projection)
    assert head["projection"] == ("the whole job (30,318 records, 1 epoch): naive 11.0\u00a0h, "
                                  "optimized 2.67\u00a0h")
    assert head["text"].endswith("\n" + head["projection"])
    assert "projection" not in report.headline(stages, found)


def test_a_source_too_small_for_the_whole_job_is_said_not_projected():
    # a diagnosis of a 20-record source must not fail on the whole job's batch: it says so
    stages = pd.DataFrame([{"run": "naive", "stage": "train", "seconds": 4.0, "share": 1.0},
                           {"run": "optimized", "stage": "train", "seconds": 1.0, "share": 1.0}])
    projection = pd.DataFrame([
        {"plan": p, "stage": "total", "seconds": float("nan"),
         "evidence": "not projected: 20 records; leaving 12 to train on"}
        for p in ("naive", "optimized")])
    head = report.headline(stages, pd.DataFrame(columns=["run"]), projection=projection)
    assert head["projection"] == "the whole job: not projected: 20 records; leaving 12 to train on"
    assert "nan" not in head["text"]
