"""diag.model_load on the embedded hub: one quick run of every scenario (shared), its parts and
advice.

The run goes through the CLI with a fake HF_TOKEN in the environment, so the same run checks that
the token appears in no output, CSV or report. Fault tests live in test_models_faults.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd
import pytest

from diag.config import ModelLoadConfig
from diag.timing import LOAD_PARTS

FAKE_TOKEN = "hf_diagFAKEtoken0123456789abcdef"


# its module fixture is made once: the file's tests share one xdist worker (make test)
pytestmark = [pytest.mark.xdist_group("test_models"), pytest.mark.slow]  # model-load workers


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory):
    """`python -m diag model-load --quick` in-process, HF_TOKEN set: (frame, stdout+stderr)."""
    import contextlib
    import io

    from diag.cli import main

    csv = tmp_path_factory.mktemp("model_load") / "model_load.csv"
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", FAKE_TOKEN)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["model-load", "--quick", "--csv", str(csv)])
    assert code == 0, err.getvalue()
    return pd.read_csv(csv), out.getvalue() + err.getvalue()


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"ModelLoadConfig.repeats=0: must be a number > 0"):
        ModelLoadConfig(repeats=0)
    with pytest.raises(ValueError, match=r"'warm' is not a scenario; allowed values are 'fresh'"):
        ModelLoadConfig(scenarios=["fresh", "warm"])
    with pytest.raises(ValueError, match=r"name each scenario once"):
        ModelLoadConfig(scenarios=["cached", "cached"])
    with pytest.raises(ValueError, match=r"ModelLoadConfig.process='spawn': allowed values are "
                                         r"'fork', 'exec'"):
        ModelLoadConfig(process="spawn")
    with pytest.raises(ValueError, match=r"ModelLoadConfig.warmup=-1"):
        ModelLoadConfig(warmup=-1)
    with pytest.raises(ValueError, match=r"ModelLoadConfig.budget_s=-1: must be a number >= 0"):
        ModelLoadConfig(budget_s=-1)
    assert ModelLoadConfig().repeats == 1  # one load a scenario: a 7B model's is minutes
    assert ModelLoadConfig(scenarios="fresh,cached").scenarios == ["fresh", "cached"]


def test_every_scenario_and_part_is_measured(quick_run):
    frame, _ = quick_run
    assert set(frame["scenario"]) == {"fresh", "cached", "cached_offline", "cached_cold"}
    assert set(frame["part"]) == set(LOAD_PARTS) | {"load_model", "from_pretrained"}
    assert (frame["repeat"] == 0).all()  # quick: one measured repeat, the warm-up not reported
    assert (frame["seconds"] >= 0).all() and (frame["process"] == "fork").all()
    assert (frame["device"] == "cpu").all() and frame["model"].eq("diag-local/tiny-llama").all()
    assert frame["warning"].isna().all()  # empty CSV cells: the tiny Llama uses every weight


def test_parts_add_up_to_the_load_processes_own_clock(quick_run):
    """load_model is import + one clock the load process keeps around the whole load, never
    the parts' sum: a part timed twice (or left out) shows here."""
    frame, _ = quick_run
    for (scenario, _repeat), rows in frame.groupby(["scenario", "repeat"]):
        seconds = rows.set_index("part")["seconds"]
        parts = seconds[list(LOAD_PARTS)].sum()
        # the tolerance stays under half of quantize (the smallest part a bug could bill twice
        # or drop: ~10 ms on the tiny model), so such a bug cannot hide in it
        tolerance = min(5e-3, seconds["quantize"] / 2)
        assert seconds["quantize"] > 2e-3, scenario
        assert abs(seconds["load_model"] - parts) < tolerance, (scenario, seconds.to_dict())


def test_import_is_measured_once_and_counted_once(quick_run):
    frame, _ = quick_run
    imports = frame[frame["part"] == "import"]["seconds"]
    # fork mode: one zygote paid it; each child adds only what it imported itself (~0 on CPU)
    assert imports.min() > 1.0 and imports.max() - imports.min() < 0.1 * imports.min()
    plain = frame[frame["part"] == "from_pretrained"]["seconds"].item()
    cached = frame[frame["scenario"] == "cached"].set_index("part")["seconds"]
    # the one-call load beside diag's split of it: the same work, give or take the machine
    assert 0.3 < plain / cached[["download", "read", "quantize", "to_device"]].sum() < 3


def test_bytes_match_the_files(quick_run):
    from diag.embedded import ensure_assets

    frame, _ = quick_run
    model_dir = ensure_assets().model_dir
    weights = (model_dir / "model.safetensors").stat().st_size
    everything = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())

    def get(s: str, p: str) -> int:
        return frame[(frame.scenario == s) & (frame.part == p)]["bytes"].item()

    assert get("fresh", "download") == everything  # every file, once
    for scenario in ("cached", "cached_offline", "cached_cold"):
        assert get(scenario, "download") == 0  # a revision check downloads nothing
        assert get(scenario, "read") == weights
    # 4-bit nf4: the linear layers pass through bitsandbytes, embeddings and norms do not
    assert 0 < get("cached", "quantize") < weights
    fresh_rate = frame[(frame.scenario == "fresh") & (frame.part == "download")]["mb_per_s"].item()
    assert fresh_rate == pytest.approx(everything / get_seconds(frame, "fresh", "download") / 1e6)


def get_seconds(frame: pd.DataFrame, scenario: str, part: str) -> float:
    return frame[(frame.scenario == scenario) & (frame.part == part)]["seconds"].item()


def test_cold_is_labelled_by_what_the_eviction_achieved(quick_run):
    frame, _ = quick_run
    states = frame.groupby("scenario")[["cache_state", "resident"]].first()
    assert states.loc["fresh", "cache_state"] == "fresh download"
    # the label and mincore's resident share of the cached files, measured just before the load
    assert states.loc["cached", "cache_state"] == "warm"
    assert states.loc["cached", "resident"] >= 0.98
    assert states.loc["cached_cold", "cache_state"] == "cold"
    assert states.loc["cached_cold", "resident"] <= 0.02


def test_advice_rests_on_the_measured_medians(quick_run):
    from diag.model_load import medians, advice

    frame, _ = quick_run
    med = medians(frame)
    fix = advice(frame)
    assert list(fix.columns) == ["stage", "finding", "seconds_saved", "evidence"]
    assert (fix["stage"] == "load_model").all() and (fix["seconds_saved"] > 0).all()
    expected = {
        "HF_HOME": med.loc["fresh", "load_model"] - med.loc["cached", "load_model"],
        "HF_HUB_OFFLINE": med.loc["cached", "download"] - med.loc["cached_offline", "download"],
        "page cache": med.loc["cached_cold", "load_model"] - med.loc["cached", "load_model"],
    }
    for key, saved in expected.items():
        rows = fix[fix["finding"].str.contains(key)]
        if saved > 0:  # no advice row without a positive measured saving
            assert rows["seconds_saved"].item() == pytest.approx(saved)
            assert "median" in rows["evidence"].item()
        else:
            assert rows.empty


def test_advice_from_a_synthetic_frame_is_exact():
    from diag.model_load import advice

    rows = []
    for scenario, download, read, state in (("fresh", 10.0, 1.0, "fresh download"),
                                           ("cached", 0.5, 1.0, "warm"),
                                           ("cached_offline", 0.1, 1.0, "warm"),
                                           ("cached_cold", 0.5, 3.0, "cold")):
        for part, seconds in (("download", download), ("read", read), ("load_model",
                                                                      download + read)):
            rows.append({"scenario": scenario, "part": part, "bytes": 100e6, "seconds": seconds,
                         "mb_per_s": 100.0, "repeat": 0, "cache_state": state,
                         "cache_disk": "network_block", "model": "m", "device": "cpu"})
    fix = advice(pd.DataFrame(rows)).set_index("seconds_saved")
    assert sorted(fix.index) == pytest.approx([0.4, 2.0, 3.0, 9.5])
    assert "network" in fix.loc[3.0, "finding"]  # the cold read from network storage
    failed = pd.DataFrame(rows).replace({"cold": "warm (eviction failed: 40% still cached)"})
    assert not advice(failed)["finding"].str.contains("page cache").any()


def test_token_never_shows_and_the_report_draws(quick_run, tmp_path: Path, monkeypatch):
    from diag import report
    from diag.model_load import advice
    from diag.plots import plot_model_load

    frame, printed = quick_run
    assert "load_model" in printed and "cached_cold" in printed  # the table was printed
    assert FAKE_TOKEN not in printed
    fig = plot_model_load(frame)
    assert len(fig.axes[0].patches) == 4 * len(LOAD_PARTS)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    folder = report.write({"model_load": frame}, tmp_path / "run",
                          advice=advice(frame), config={"model": ""})
    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    assert any(p.name == "model_load.csv" for p in files)
    assert any(p.suffix == ".png" and "model_load" in p.name for p in files), files
    for p in files:
        assert FAKE_TOKEN.encode() not in p.read_bytes(), p
    assert not math.isnan(frame["seconds"].sum())
    assert os.environ.get("HF_TOKEN") == FAKE_TOKEN  # the report ran with the token set


def test_a_budget_repeats_the_loads_until_the_model_cache_gap_resolves():
    """With room in budget_s (diag run gives its share) fresh and cached loads repeat,
    interleaved, past `repeats` until the model_cache decision resolves: one load a side never
    can (diag.noise needs MIN_SAMPLES a side); the decision carries its samples and spread."""
    from diag.model_load import run_model_load
    from diag.model_load.experiment import decide
    from diag.noise import MIN_SAMPLES

    got = run_model_load(ModelLoadConfig(scenarios=["fresh", "cached"], budget_s=120.0))
    loads = got.frame[got.frame["part"] == "load_model"]
    per = loads.groupby("scenario")["repeat"].nunique()
    assert per["fresh"] == per["cached"] >= MIN_SAMPLES
    (decision,) = got.decisions
    assert decision.samples == (per["cached"], per["fresh"]) and len(decision.spread) == 2
    assert decision.resolved == (decision.basis == "measured")
    if decision.resolved:  # the cached copy skips the download
        assert decision.value == "persistent"
    if per["cached"] > MIN_SAMPLES:  # a repeat past the minimum only while it was unresolved
        before = got.frame[got.frame["repeat"] < got.frame["repeat"].max()]
        assert not decide(before)[0].resolved
