import json
import re

import pandas as pd
import pytest

from diag import report
from diag.cli import main
from tests.test_amdahl import constructed


def frames():
    run = pd.concat([constructed("naive"), constructed("optimized", fetch=0.5, load=2.0)],
                    ignore_index=True)
    run["rank"] = 0
    other = pd.DataFrame({"method": ["a", "b"], "mb_per_s": [410.5, 1.0 / 3], "repeat": [0, 1]})
    return {"run": run, "storage_like": other}


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
    assert summary["top_finding"].startswith("land the dataset on local NVMe")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial left


def test_html_is_self_contained_with_every_figure_and_the_stage_table(tmp_path):
    folder = report.write(frames(), tmp_path / "r2")
    page = (folder / "report.html").read_text()
    pngs = sorted(p.stem for p in folder.glob("*.png"))
    assert pngs == ["amdahl", "stage_shares", "waterfall"]
    for name in pngs:
        assert re.search(
            rf'<img alt="{name}" src="data:image/png;base64,[A-Za-z0-9+/=]{{1000,}}"', page)
    assert "<h2>Stage shares</h2>" in page and "fetch_data" in page and "data_wait" in page
    assert "src=\"http" not in page and "href=" not in page  # opens from disk, nothing fetched


def test_the_page_leads_with_the_headline_and_summary_json_carries_it(tmp_path):
    folder = report.write(frames(), tmp_path / "rh")
    summary = report.load_summary(folder)
    head = summary["headline"]
    stages = pd.DataFrame(summary["stages"])
    totals = stages.groupby("run")["seconds"].sum()
    assert head["naive_s"] == pytest.approx(totals["naive"])
    assert head["optimized_s"] == pytest.approx(totals["optimized"])
    assert head["speedup"] == pytest.approx(totals["naive"] / totals["optimized"])
    naive = stages[stages["run"] == "naive"]
    assert head["largest_stage"] == naive.loc[naive["seconds"].idxmax(), "stage"]
    assert head["top_fix"] == summary["findings"][0]["finding"]
    page = (folder / "report.html").read_text()
    body = page[page.index("<body>"):]
    # the headline first (comparison, largest stage, top fix), then the details
    order = [body.index(f"optimized {head['optimized_s']:.3g} s"),
             body.index(f"<b>{head['largest_stage']}</b>"),
             body.index("Top fix: " + summary["top_finding"].split(":")[0]),
             body.index("<h2>Stage shares</h2>")]
    assert order == sorted(order) and body.startswith("<body><h1>naive ")


def test_a_single_run_has_no_headline_and_keeps_its_top_finding(tmp_path):
    one = frames()
    one["run"] = one["run"][one["run"]["run"] == "naive"]
    folder = report.write(one, tmp_path / "r1run")
    assert report.load_summary(folder).get("headline") is None
    page = (folder / "report.html").read_text()
    assert "<h1>diag report</h1>" in page and "Top finding: " in page and "&rarr;" not in page


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
