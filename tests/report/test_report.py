import json
import re
import runpy
from pathlib import Path

import pandas as pd
import pytest

from diag import decision, report, storage
from diag.cli import main
from diag.decision import Decision, MeasuredOn
from diag.report import page
from diag.report.units import cell
from tests.test_amdahl import constructed


def frames():
    run = pd.concat([constructed("naive"), constructed("optimized", fetch=0.5, load=2.0)],
                    ignore_index=True)
    run["rank"] = 0
    other = pd.DataFrame({"method": ["a", "b"], "mb_per_s": [410.5, 1.0 / 3], "repeat": [0, 1]})
    return {"run": run, "storage_like": other}


def storage_frame() -> pd.DataFrame:
    rows = [{"method": method, "source": "s3://bucket/k.jsonl", "cache_state": state,
             "bytes": 64_000_000, "seconds": 64 / rate, "mb_per_s": rate, "repeat": r}
            for method, state, rate in (("boto3_default", "remote", 80.0), ("land", "miss", 150.0),
                                        ("land", "hit", 1000.0), ("local_read", "cold", 2600.0))
            for r in range(2)]
    return pd.DataFrame(rows)


LOADER_ON = MeasuredOn(model="tiny Llama + LoRA", precision="nf4", seq_len=128,
                       step="the QLoRA step", device="cpu")


def folder_frames() -> dict[str, pd.DataFrame]:
    """What a `diag run` folder holds, constructed: both runs, a storage sweep and its real
    decision, a loader sweep 30 columns wide with a measured, a projected and a default
    decision, the QLoRA runs' predicted vs measured savings."""
    workers = [0, 2, 0, 2]
    loader = pd.DataFrame({"pipeline": ["naive", "naive", "packed", "packed"],
                           "num_workers": workers, "data_wait_share": [0.3, 0.01, 0.05, 0.004],
                           "step_s": 0.0472, "tokens_per_s": [1583.4, 9000.0, 2500.0, 12000.0]})
    for i in range(26):  # wide as the real sweep: the table scrolls in its own box
        loader[f"extra_column_{i}_s"] = 0.01804 * (i + 1)
    rows = loader.head(2).to_dict("records")
    decided = [*storage.decide(storage_frame()),
               Decision.from_rows("num_workers", 2, "2 workers: data_wait 1.0% of a 47.2 ms step",
                                  rows, source="loader", measured_on=LOADER_ON),
               Decision.from_rows("num_workers", 4, "4 workers keep up with a 3 ms step", rows,
                                  source="loader", basis="projected",
                                  measured_on=MeasuredOn(step="H100 SXM estimate")),
               Decision.default("pin_memory", True, "not varied by the sweep", source="loader")]
    return {**frames(), "storage": storage_frame(), "loader": loader,
            "loader_projected": loader.head(2), **comparison(),
            "decisions": decision.frame(decided)}


def comparison() -> dict[str, pd.DataFrame]:
    """A QLoRA comparison's frames, read from a constructed cost table as run_qlora reads them:
    the savings predicted vs measured, the waterfall, the headline's row."""
    from diag.forecast import costs as table
    from diag.forecast import story
    from tests.forecast.test_costs import COUNTS, FIXES, _rows

    rows = _rows()
    costs = table.table(rows)
    before, runs = (table.price(costs, COUNTS, clock="CPU", when=w) for w in ("before", "runs"))
    flow = story.waterfall(runs, "CPU", FIXES)
    totals = dict(zip(flow["bar"], flow["seconds"]))
    head = story.headline(story.rounds_of(rows, "CPU"), {"naive": 800, "optimized": 800}, "CPU",
                          totals)
    return {"qlora_costs": costs, "qlora_savings": story.check(before, runs, "CPU", FIXES),
            "qlora_waterfall": flow,
            "qlora_comparison": pd.DataFrame([head | {"changed": ",".join(FIXES)}])}


INFO = pd.DataFrame({"fact": ["accelerator", "cpu_model", "cpu_cores_logical", "ram_gb"],
                     "value": ["none", "AMD EPYC", "2", "25.3"]})


def write_run(out: Path) -> Path:
    """A constructed `diag run` folder (the browser test reads it too)."""
    return report.write(folder_frames(), out, info=INFO, advice=pd.DataFrame(
        [{"stage": "fetch_data", "finding": "land it once", "seconds_saved": 20.0,
          "evidence": "0.8 s per start"}]))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One constructed `diag run` folder, written once for the page's tests."""
    folder = write_run(tmp_path_factory.mktemp("report") / "run")
    return folder, (folder / "report.html").read_text()


def section(page_text: str, key: str) -> str:
    found = re.search(rf"<section class=experiment id={key}>(.*?)</section>", page_text, re.S)
    assert found, f"no section {key}"
    return found.group(1)


def test_round_trip_write_then_load_gives_equal_frames(tmp_path):
    made = frames()
    folder = report.write(made, tmp_path / "r1", config={"steps": 3})
    loaded = report.load(folder)
    for name, frame in made.items():
        pd.testing.assert_frame_equal(loaded[name], frame.reset_index(drop=True))
    summary = report.load_summary(folder)
    assert summary["config"] == {"steps": 3}
    assert {"python", "pandas"} <= set(summary["versions"])
    shares = pd.DataFrame(summary["stages"])
    assert shares.groupby("run")["share"].sum().round(9).eq(1.0).all()
    assert summary["top_finding"].startswith("land the dataset once")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial left


def test_the_page_is_self_contained_and_links_only_its_own_csvs(written):
    folder, text = written
    pngs = sorted(p.stem for p in folder.glob("*.png"))
    assert pngs == ["amdahl", "loader", "stage_shares", "storage", "timeline", "waterfall"]
    for name in pngs:
        assert re.search(
            rf'<img alt="{name}" src="data:image/png;base64,[A-Za-z0-9+/=]{{1000,}}"', text)
    assert "src=\"http" not in text
    links = re.findall(r'href="([^"]*)"', text)  # opens from disk, links into its own folder
    assert set(links) == {p.name for p in folder.glob("*.csv")}


def test_the_page_leads_with_the_verdict_the_headline_and_the_top_fix(written):
    folder, text = written
    summary = report.load_summary(folder)
    head = summary["headline"]
    body = text[text.index("<body>"):]
    assert body.startswith("<body><header><h1>Naive run: start-up-bound: 91% of the run is spent"
                           " starting (fetch, model load, preprocess, set-up, warm-up)</h1>")
    assert (head["verdict"], head["resolved"], head["rounds"], head["clock"]) == (
        "start-up-bound", True, 5, "CPU")
    order = [body.index("<p class=head>Naive 9.32 CPU s -&gt; optimized 3.47 CPU s per start: "
                        "2.7x faster per trained token, resolved over 5 interleaved rounds"),
             body.index("<p class=top>Top fix: micro_batch 1 -&gt; 4 (train: saved 2.4 CPU s)"),
             body.index("CPU only (no accelerator), AMD EPYC, 2 cores, 25.3\u00a0GB RAM"),
             body.index("<h2>What each stage saved: predicted before the runs, measured in "
                        "them</h2><p class=ev>A prediction is flagged when it misses by more "
                        "than 25% of itself"),
             body.index("<h2>What is left: fixes the optimized plan did not apply"),
             body.index("<section class=experiment")]
    assert order == sorted(order)
    fixes = body[order[3]:order[5]]
    assert ("<b>fetch_data</b>: fetch pull -&gt; land: predicted 810\u00a0ms CPU, measured "
            "900\u00a0ms CPU") in fixes
    assert "<b>setup</b>: unchanged: predicted 0\u00a0s CPU" in fixes
    # what is left: the optimized run's findings on stages no applied fix changed
    left = [f for f in summary["findings"] if f["run"] == "optimized"
            and f["stage"] not in head["changed"]]
    places = [fixes.index(f"<b>{f['finding']}</b>") for f in left]
    assert left and places == sorted(places) and all(f["evidence"] in fixes for f in left)
    what_is_left = fixes[order[4] - order[3]:]
    assert decision.FIXES["load_model"] not in what_is_left  # the plan applied it
    assert decision.FIXES["data_wait"] in what_is_left


def test_each_section_opens_with_its_decisions_evidence_then_its_figure(written):
    _, text = written
    fetch = section(text, "storage")
    said = re.match(r"<h2>Storage: object store vs local disk</h2><p class=conclusion>(.*?)</p>"
                    r'<img alt="storage"', fetch)
    assert said and said.group(1).startswith("<b>fetch = land</b>, measured on the fetch of "
                                             "s3://bucket/k.jsonl, this machine: land() hit ")
    loader = section(text, "loader")
    assert ("<b>num_workers = 2</b>, measured on tiny Llama + LoRA, nf4, seq_len 128, the QLoRA "
            "step, cpu: 2 workers: data_wait 1.0% of a 47.2 ms step") in loader
    assert "Defaults kept: pin_memory True" in loader and "4 workers" not in loader
    projected = section(text, "loader_projected")  # the projected decision speaks here
    assert projected.index("<b>num_workers = 4</b>, projected on H100 SXM estimate") < \
        projected.index("<details>")
    shares = section(text, "run")
    assert re.match(r"<h2>Where the run's time goes</h2><p class=conclusion>The naive run took "
                    r"43.9\u00a0s, fetch_data its largest stage \(68.3%\); the optimized run took "
                    r'6.40\u00a0s, compute its largest stage \(50.0%\).</p><img alt="stage_shares"',
                    shares)
    for key in re.findall(r"<section class=experiment id=(\w+)>", text):
        said = re.match(r"<h2>[^<]+</h2><p class=conclusion>(.*?)</p>", section(text, key))
        assert said and re.sub("<[^>]+>", "", said.group(1)).strip(), key


def test_raw_tables_are_folded_linked_and_show_units(written):
    _, text = written
    loader = section(text, "loader")
    assert ('<details><summary><a href="loader.csv">loader.csv</a>: 4 rows, 31 columns'
            '</summary><div class=scroll>') in loader
    assert "<td>18.0\u00a0ms</td>" in loader and "<td>1.58k\u00a0tokens/s</td>" in loader
    assert "<td>30.0%</td>" in loader and "0.01804" not in loader
    decisions = text[text.index('<a href="decisions.csv">'):]
    assert "<th>why</th>" in decisions.split("</table>")[0]
    assert '{"setting"' not in text  # a decision's whole json is for the CSV, not the page


def test_the_readme_figure_is_the_headline_over_the_stage_shares(written):
    folder, _ = written
    tool = runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "readme_figure.py"))
    summary = report.load_summary(folder)
    ax = tool["figure"](folder).axes[0]
    words = " ".join(ax.get_title().split())
    assert words.startswith(" ".join(summary["headline"]["text"].split()))
    assert words.endswith("measured on CPU only (no accelerator), AMD EPYC, 2 cores, 25.3 GB RAM")
    assert len(ax.patches) == len(summary["stages"])  # one bar per stage of each run


@pytest.mark.parametrize("column, value, shown", [
    ("step_s", 0.01804, "18.0 ms"), ("seconds", 3.686e-05, "36.9 µs"),
    ("seconds_saved", 0.9997, "1.00 s"), ("seconds", 7500.0, "2.08 h"), ("data_s", 0.0, "0 s"),
    ("per_sample_ms", 0.3997, "400 µs"), ("hours_per_week", 0.5, "30.0 min"),
    ("data_wait_share", 0.0064, "0.640%"), ("share_of_run", 1.0, "100%"), ("mfu", 0.412, "41.2%"),
    ("peak_mem_gb", 0.00634, "6.34 MB"), ("bytes", 64_000_013, "64.0 MB"),
    ("tokens_per_s", 1583.4, "1.58k tokens/s"), ("mb_per_s", 2034.0, "2.03 GB/s"),
    ("usd_per_week", 2.5, "$2.50"), ("micro_batch", 4, "4"), ("real_tokens", 1809.0, "1,809"),
    ("low", 1.8274, "1.83"), ("status", "ok", "ok"), ("flagged", True, "True"),
    ("measured_s", float("nan"), "")])
def test_numbers_carry_the_unit_their_column_names(column, value, shown):
    assert cell(column, value).replace("\u00a0", " ") == shown


def test_a_single_experiment_folder_reads_as_well(tmp_path):
    # what `diag storage --report` writes: its tables, advice and decision, no runs to compare
    tax = pd.DataFrame({"method": ["boto3_default"], "seconds_per_run": [0.8],
                        "usd_per_week": [1.5]})
    advice = pd.DataFrame([{"stage": "fetch_data", "finding": "land it once", "seconds_saved": 0.7,
                            "evidence": "0.8 s per start"}])
    folder = report.write({"storage": storage_frame(), "storage_tax": tax,
                           "decisions": decision.frame(storage.decide(storage_frame()))},
                          tmp_path / "one", advice=advice)
    text = (folder / "report.html").read_text()
    assert report.load_summary(folder).get("headline") is None and "&rarr;" not in text
    assert "<h1>diag report: storage</h1>" in text
    assert ("<h2>Fixes, largest saving first</h2><ol><li><b>land it once</b>: saves "
            "700\u00a0ms per start") in text
    assert section(text, "storage").count("<details>") == 2  # storage.csv, storage_tax.csv
    assert "$1.50" in text and "<b>fetch = land</b>" in text
    assert "CPU only" not in text  # no info.csv: the page claims no machine


def test_a_single_run_names_itself_and_keeps_its_top_finding(tmp_path):
    one = frames()  # what `diag toy --report` writes: one run's stages
    one["run"] = one["run"][one["run"]["run"] == "naive"]
    folder = report.write(one, tmp_path / "r1run")
    text = (folder / "report.html").read_text()
    assert "<h1>Start-up-bound: 91% of the run is spent starting" in text
    assert "<p class=top>Top fix: land the dataset" in text and "faster" not in text


def test_sections_follow_the_page_order_and_unknown_experiments_keep_their_frames():
    names = ["loader_projected_lines", "qlora_rounds", "zeta", "zeta_extra", "storage_tax",
             "loader", "run", "decisions", "storage", "loader_projected"]
    made = {n: pd.DataFrame({"x": [1]}) for n in names}
    made["decisions"] = decision.frame([Decision.default("fetch", "land", "no rows", "storage")])
    got = page.sections(made)
    assert list(got) == ["run", "qlora", "storage", "loader", "loader_projected", "zeta"]
    assert got["loader_projected"] == ["loader_projected_lines", "loader_projected"]
    assert got["zeta"] == ["zeta", "zeta_extra"] and got["storage"] == ["storage_tax", "storage"]


def test_a_run_is_never_overwritten(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = report.write(frames())
    second = report.write(frames())
    assert first.parent == second.parent == tmp_path / "runs"
    assert first.exists() and second.exists() and first != second
    with pytest.raises(ValueError, match="already holds files; a run is never overwritten"):
        report.write(frames(), first)


def test_failed_write_leaves_no_folder(tmp_path):
    bad = frames()
    bad["run"].loc[0, "stage"] = "gpu_time"  # outside the vocabulary: fails mid-write
    with pytest.raises(ValueError, match="unknown stage"):
        report.write(bad, tmp_path / "r3")
    assert list(tmp_path.iterdir()) == []


def test_rerender_from_csvs(tmp_path):
    folder = report.write(frames(), tmp_path / "r4")
    (folder / "report.html").unlink()
    (folder / "amdahl.png").unlink()
    assert main(["report", str(folder)]) == 0
    assert (folder / "report.html").is_file() and (folder / "amdahl.png").is_file()
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_secrets_never_reach_the_report(tmp_path, monkeypatch):
    secret = "hf_FAKEtoken1234567890"
    monkeypatch.setenv("HF_TOKEN", secret)
    made = frames()
    made["storage_like"]["method"] = [f"https://user:{secret}@host/x", "b"]  # e.g. an error text
    folder = report.write(made, tmp_path / "r5", config={"note": f"token was {secret}"})
    for path in folder.iterdir():
        assert secret.encode() not in path.read_bytes(), path.name
    assert "***" in json.loads((folder / "summary.json").read_text())["config"]["note"]


def test_amdahl_figure_marks_current_and_target_gpu(tmp_path):
    folder = report.write(frames(), tmp_path / "r6",
                          config={"current_gpu": "RTX 4070", "target_gpu": "H100 SXM"})
    marks = report.gpu_marks(report.load_summary(folder))
    assert marks == pytest.approx({"RTX 4070 (now)": 1.0, "H100 SXM": 989.4 / 58.3})
    # a CPU-only box with no GPU named: nothing to mark, no guess
    assert report.gpu_marks({"config": {}, "device": {"accelerator": "none"}}) is None


def test_the_headline_top_fix_is_one_a_setting_makes():
    # the Trainer's set-up is the naive run's largest stage (as in a quick `diag run`): the
    # verdict counts it, but its top fix is one a setting makes
    from diag import amdahl

    run = frames()["run"]
    setup = pd.DataFrame({"stage": "setup", "seconds": 60.0, "step": pd.NA,
                          "run": ["naive", "optimized"], "rank": 0})
    run = pd.concat([run, setup], ignore_index=True)
    head = report.headline(amdahl.shares(run), amdahl.findings(run))
    assert head["verdict"] == "start-up-bound"
    assert head["top_fix"].startswith(decision.FIXES["fetch_data"])
    assert head["top_fix_saves_s"] == 30.0


def test_a_compute_bound_run_whose_micro_batch_memory_capped_is_memory_bound(tmp_path):
    from diag import amdahl

    run = pd.DataFrame({"stage": ["fetch_data", "compute", "compute"], "seconds": [1.0, 5.0, 5.0],
                        "step": [pd.NA, 0, 1], "run": "naive", "rank": 0})
    assert report.headline(amdahl.shares(run), amdahl.findings(run))["verdict"] == "compute-bound"
    sweep = pd.read_csv(Path(__file__).parents[2] / "docs" / "example" / "accum.csv")
    oom = sweep.iloc[[0]].assign(micro_batch=8, grad_accum=0, status="oom")
    assert not report.capped({"accum": sweep})
    # an OOM below a point that ran (a fluke) caps nothing
    assert not report.capped({"accum": pd.concat([sweep, oom.assign(micro_batch=3)])})
    sweep = pd.concat([sweep, oom], ignore_index=True)
    folder = report.write({"run": run, "accum": sweep}, tmp_path / "r")
    head = report.load_summary(folder)["headline"]
    assert head["verdict"] == "memory-bound" and head["text"].startswith("memory-bound: ")


def test_the_glossary_is_folded_in_the_page_and_the_same_in_the_docs(written):
    _, text = written
    docs = (Path(__file__).resolve().parents[2] / "docs" / "glossary.md").read_text()
    assert "<details><summary>Glossary</summary><dl>" in text
    for term, meaning in page.GLOSSARY.items():
        assert f"**{term}**: {meaning}" in docs
        assert f"<dt><b>{term}</b></dt>" in text


def test_a_busy_machine_is_said_on_top_with_its_threshold(tmp_path):
    from diag.machine.contention import busy

    quiet = {"load_1min": 0.4, "load_max": 0.9, "cores": 2, "others_share": 0.02,
             "steal_share": 0.0, "gpu_other_processes": None, "wall_over_cpu": 1.05}
    loaded = quiet | {"load_1min": 5.3, "others_share": 0.61, "wall_over_cpu": 2.3}
    assert busy(quiet) == ""
    said = busy(loaded)
    assert said.startswith("the machine was busy: load 5.3 on 2 cores, other processes took 61%")
    assert "wall seconds ran 2.3x its CPU seconds" in said and "others over 25%" in said
    folder = report.write(frames(), tmp_path / "busy", machine=loaded)
    text = (folder / "report.html").read_text()
    assert "<p class=busy>The machine was busy: load 5.3 on 2 cores" in text
    assert report.load_summary(folder)["machine"]["others_share"] == 0.61
    calm = report.write(frames(), tmp_path / "calm", machine=quiet)
    assert "class=busy>" not in (calm / "report.html").read_text()
