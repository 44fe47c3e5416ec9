"""`python -m diag run` (what `make demo` runs), end to end on the embedded defaults, quick."""

import json

import pytest

from diag import report
from tests.conftest import FAKE_HF_TOKEN, QUICK_RUN


pytestmark = pytest.mark.xdist_group(QUICK_RUN)


@pytest.fixture()
def demo(quick_run):
    return quick_run


@pytest.mark.slow
def test_demo_writes_every_experiment_and_prints_path_and_the_story(demo):
    out, done = demo
    lines = done.stdout.strip().splitlines()
    assert lines[0] == f"wrote {out / 'report.html'}"
    head = report.load_summary(out)["headline"]  # the lines the report's page leads with
    assert lines[1:1 + len(head["text"].split("\n"))] == head["text"].split("\n")
    assert lines[1].startswith("naive run: ") and "-bound: " in lines[1]
    assert "not resolved in 1 round" in head["text"] and "top fix: " in head["text"]
    names = {p.name for p in out.iterdir()}
    assert {"run.csv", "info.csv", "storage.csv", "storage_tax.csv", "model_load.csv",
            "qlora.csv", "qlora_losses.csv", "qlora_plans.csv", "qlora_savings.csv",
            "qlora_mfu.csv", "qlora_costs.csv", "qlora_waterfall.csv", "qlora_comparison.csv",
            "advice.csv", "summary.json", "report.html", "stage_shares.png",
            "amdahl.png", "waterfall.png", "storage.png", "model_load.png", "accum.csv",
            "accum_summary.csv",
            "accum.png", "checkpointing.csv", "decisions.csv", "loader.csv", "loader_stalls.csv",
            "loader_lines.csv", "loader_recommendation.csv", "loader.png"} <= names
    page = (out / "report.html").read_text()
    # every figure of the folder is on the page, once
    assert page.count('src="data:image/png;base64,') == len(list(out.glob("*.png"))) >= 7


@pytest.mark.slow
def test_runs_are_the_qlora_plans_fed_by_the_measured_frames(demo):
    out, done = demo
    frames = report.load(out)
    run, plans = frames["run"], frames["qlora_plans"]
    # the naive vs optimized runs are the QLoRA job, each stage measured in the run itself
    for plan in ("naive", "optimized"):
        assert {"fetch_data", "load_model", "preprocess", "warmup", "compute"} <= set(
            run.loc[run["run"] == plan, "stage"])
    evidence = plans[plans["run"] == "optimized"].set_index("setting")["evidence"]
    assert evidence["fetch"].startswith("measured") and "land() hit" in evidence["fetch"]
    # loads repeat while the model-load step's share allows: a resolved gap is measured, an
    # unresolved one keeps the default and says so
    cache = evidence["model_cache"]
    assert (cache.startswith("measured") and "resolved (" in cache) or (
        cache.startswith("default") and "within noise" in cache), cache
    # decided on the job's own step: what was measured is named, and it is the QLoRA step
    decided = frames["decisions"].set_index("setting")
    for setting in ("micro_batch", "gradient_checkpointing", "num_workers", "pipeline"):
        assert decided.at[setting, "basis"] == "measured", setting
        assert "the QLoRA step" in decided.at[setting, "measured_on"], setting
        assert "LoRA" in decided.at[setting, "measured_on"], setting
    assert plans.set_index(["run", "setting"]).at[("optimized", "micro_batch"), "value"] == str(
        frames["qlora"].set_index("plan").at["optimized", "micro_batch"])  # shown == run
    saved = frames["qlora_savings"].set_index("stage")
    shown = plans.set_index(["run", "setting"])["value"]
    for setting, stage in (("fetch", "fetch_data"), ("model_cache", "load_model")):
        # a per-start fix is predicted exactly when the measurements made the plans differ in
        # it (on a loaded box a tiny model's cached load can measure no faster than a fresh one)
        differ = shown[("naive", setting)] != shown[("optimized", setting)]
        listed = stage in saved.index and bool(saved.loc[[stage], "predicted_s"].notna().all())
        assert listed == differ, (setting, shown[("naive", setting)], shown[("optimized", setting)])
    summary = json.loads((out / "summary.json").read_text())
    stages = {(s["run"], s["stage"]) for s in summary["stages"]}
    assert {("naive", "fetch_data"), ("naive", "load_model"), ("optimized", "compute")} <= stages
    assert summary["findings"] and summary["top_finding"]
    assert summary["device"]["cpu_model"] and {"peak_tflops_bf16", "peak_tflops_fp32"} & set(
        summary["device"])


@pytest.mark.slow
def test_demo_leaks_no_secret(demo):
    out, done = demo
    assert FAKE_HF_TOKEN not in done.stdout + done.stderr
    for path in out.iterdir():
        assert FAKE_HF_TOKEN.encode() not in path.read_bytes(), path.name


@pytest.mark.slow
def test_the_story_adds_up_on_one_clock_from_the_cost_table(demo):
    # the fixes' measured savings and one named residual add up to naive minus optimized; the
    # waterfall ends at the measured optimized total; the headline's ratio is summary.json's
    out, _ = demo
    frames = report.load(out)
    flow = frames["qlora_waterfall"].set_index("bar")
    naive, optimized = flow.at["naive", "seconds"], flow.at["optimized", "seconds"]
    changes = flow.drop(index=["naive", "optimized"])["change"]
    assert "unchanged" in changes.index and changes.drop(index="unchanged").lt(0).any()
    assert naive + changes.sum() == pytest.approx(optimized, rel=0.01)
    costs = frames["qlora_costs"]
    clock = flow["clock"].iloc[0]
    runs = costs[(costs["when"] == "runs") & (costs["clock"] == clock)]
    rounds = frames["qlora_rounds"].set_index("plan")
    from diag.forecast.eta import run_counts

    for plan, total in (("naive", naive), ("optimized", optimized)):  # measured: costs x counts
        n = run_counts(rounds.loc[[plan]].iloc[0].to_dict())
        mine = runs[(runs["plan"] == plan) & (runs["stage"] != "download")]
        assert (mine["seconds"] * mine["unit"].map(n)).sum() == pytest.approx(total, rel=0.01)
    summary = report.load_summary(out)
    head, row = summary["headline"], frames["qlora_comparison"].iloc[0]
    assert head["speedup"] == pytest.approx(row["speedup"]) == pytest.approx(naive / optimized)
    assert (head["resolved"], head["clock"]) == (bool(row["resolved"]), clock)
    assert {"verdict", "resolved", "low", "high"} <= set(head)
    assert head["top_fix"].split(" (")[0] == flow.loc[changes.drop(
        index="unchanged").idxmin(), "fixes"]


@pytest.mark.slow
def test_the_eta_and_the_projection_price_the_job_from_the_same_rows(demo):
    from diag.forecast.eta import costs_in

    out, done = demo
    frames = report.load(out)
    totals = frames["qlora_projection"].query("stage == 'total'").set_index("plan")
    assert set(totals.index) == {"naive", "optimized"} and (totals["seconds"] > 0).all()
    # every record of the embedded source (counted), one epoch, each plan's measured costs
    assert totals.at["naive", "evidence"].endswith(", 1 epoch")
    head = report.load_summary(out)["headline"]
    assert head["projection"].startswith("the whole job (") and head["projection"] in done.stdout
    eta = costs_in(out, "optimized")  # what `diag train --results` prices its ETA at
    priced = frames["qlora_projection_costs"]
    mine = priced[priced["plan"] == "optimized"].reset_index(drop=True)
    cols = ["stage", "unit", "seconds"]
    assert eta[cols].reset_index(drop=True).equals(mine[cols])
    assert set(eta["clock"]) == {"wall"}  # an ETA is a promise about the wall clock
    got = eta.set_index(["stage", "unit"])["seconds"]
    assert got["train", "slot"] > 0 and got["preprocess", "byte"] > 0
