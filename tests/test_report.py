import json
import re

import pandas as pd
import pytest

from diag import report
from diag.__main__ import main
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
        assert re.search(rf'<img alt="{name}" src="data:image/png;base64,[A-Za-z0-9+/=]{{1000,}}"', page)
    assert "<h2>Stage shares</h2>" in page and "fetch_data" in page and "data_wait" in page
    assert "src=\"http" not in page and "href=" not in page  # opens from disk, nothing fetched


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
