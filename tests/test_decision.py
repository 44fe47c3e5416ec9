"""diag.decision: a decision's basis and evidence, what it is worth, and one owner per setting
(constructed decisions; no experiment runs)."""

from __future__ import annotations

import pandas as pd
import pytest

from diag.decision import Decision, MeasuredOn, by_setting, frame

ON = MeasuredOn(model="tiny (nf4 + LoRA)", precision="nf4", seq_len=96, step="the QLoRA step",
                device="cpu")


def test_measured_on_names_only_what_is_known_in_order():
    assert ON.label() == "tiny (nf4 + LoRA), nf4, seq_len 96, the QLoRA step, cpu"
    assert MeasuredOn().label() == ""
    assert MeasuredOn(seq_len=512, device="cuda:0").label() == "seq_len 512, cuda:0"
    assert MeasuredOn(model="m", seq_len=0).label() == "m"


def test_a_basis_outside_the_four_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"Decision.basis='guessed': allowed values are"):
        Decision("fetch", "land", "guessed", "why", rows=({"x": 1},))


@pytest.mark.parametrize("basis", ["measured", "capped", "projected"])
def test_a_measured_basis_without_rows_is_refused(basis):
    with pytest.raises(ValueError) as err:
        Decision("fetch", "land", basis, "why")
    assert str(err.value) == (f"Decision('fetch').rows: a {basis} decision names the rows it "
                              "rests on; use Decision.default(...) when there are none")
    assert Decision("fetch", "land", basis, "why", rows=({"x": 1},)).basis == basis


def test_a_default_has_no_rows_and_says_why():
    d = Decision.default("num_workers", 2, "loader frame absent", source="loader")
    assert (d.setting, d.value, d.basis, d.why, d.source) == ("num_workers", 2, "default",
                                                              "loader frame absent", "loader")
    assert d.rows == () and d.measured_on == MeasuredOn() and d.saving_s() is None
    assert Decision.default("fetch", "land", "w").source == ""


def test_from_rows_keeps_the_rows_as_records_and_what_the_choice_is_worth():
    rows = pd.DataFrame({"num_workers": [0, 2], "data_wait_s": [0.2, 0.01]})
    d = Decision.from_rows("num_workers", 2, "fewest under 2%", rows, source="loader",
                           measured_on=ON, baseline=0, stage="data_wait", per="step",
                           baseline_s=0.2, chosen_s=0.01)
    assert d.rows == ({"num_workers": 0, "data_wait_s": 0.2},
                      {"num_workers": 2, "data_wait_s": 0.01})
    assert (d.basis, d.source, d.measured_on) == ("measured", "loader", ON)
    assert (d.baseline, d.stage, d.per, d.baseline_s, d.chosen_s) == (0, "data_wait", "step",
                                                                       0.2, 0.01)
    listed = Decision.from_rows("pin_memory", 1, "w", iter([{"a": 1}]), source="s",
                                basis="projected")
    assert listed.rows == ({"a": 1},) and listed.basis == "projected"
    assert listed.measured_on == MeasuredOn()


def test_saving_is_baseline_less_chosen_times_the_count():
    d = Decision.from_rows("fetch", "land", "w", [{}], source="storage", baseline_s=9.0,
                           chosen_s=0.5)
    assert d.saving_s() == 8.5 and d.saving_s(4) == 34.0
    slower = Decision.from_rows("fetch", "land", "w", [{}], source="s", baseline_s=1.0,
                                chosen_s=3.0)
    assert slower.saving_s(2) == -4.0
    assert Decision.from_rows("fetch", 1, "w", [{}], source="s", baseline_s=1.0).saving_s() \
        is None
    assert Decision.from_rows("fetch", 1, "w", [{}], source="s", chosen_s=1.0).saving_s() is None


def test_capping_keeps_the_evidence_and_says_so():
    d = Decision.from_rows("micro_batch", 16, "fastest", [{"micro_batch": 16}], source="accum",
                           measured_on=ON, baseline_s=4.0, chosen_s=1.0)
    assert d.capped(16, "no change") is d
    c = d.capped(12, "12 rows per step")
    assert (c.value, c.basis, c.rows, c.measured_on, c.chosen_s) == (12, "capped", d.rows, ON,
                                                                      1.0)
    assert c.why == "fastest; capped to 12: 12 rows per step"
    default = Decision.default("prefetch_factor", 2, "documented").capped(None, "no workers")
    assert (default.basis, default.value) == ("default", None)
    assert default.why == "documented; capped to None: no workers"


def test_evidence_is_the_basis_what_it_was_measured_on_and_why():
    d = Decision.from_rows("micro_batch", 4, "fastest point", [{}], source="accum",
                           measured_on=ON)
    assert d.evidence() == ("measured on tiny (nf4 + LoRA), nf4, seq_len 96, the QLoRA step, "
                            "cpu: fastest point")
    assert Decision.default("fetch", "land", "absent").evidence() == "default: absent"


def test_the_frame_has_one_row_per_decision_with_its_record():
    d = Decision.from_rows("num_workers", 2, "w", [{}, {}], source="loader", measured_on=ON,
                           baseline=0, stage="data_wait", per="step", baseline_s=0.2,
                           chosen_s=0.01)
    f = frame([d, Decision.default("fetch", "land", "absent")])
    assert list(f.columns) == ["setting", "value", "basis", "source", "measured_on", "why",
                               "model", "precision", "seq_len", "step", "device",
                               "tokens_per_step", "rows", "baseline", "stage", "per",
                               "baseline_s", "chosen_s", "naive_ratio", "clock", "json"]
    assert f.iloc[0].drop("json").to_dict() == {
        "setting": "num_workers", "value": 2, "basis": "measured", "source": "loader",
        "measured_on": ON.label(), "why": "w", "model": "tiny (nf4 + LoRA)", "precision": "nf4",
        "seq_len": 96, "step": "the QLoRA step", "device": "cpu", "tokens_per_step": None,
        "rows": 2, "baseline": 0, "stage": "data_wait", "per": "step", "baseline_s": 0.2,
        "chosen_s": 0.01, "naive_ratio": None, "clock": ""}
    assert (f.iloc[1]["setting"], f.iloc[1]["rows"], f.iloc[1]["basis"]) == ("fetch", 0,
                                                                             "default")
    assert list(frame([]).columns) == list(f.columns) and frame([]).empty


def test_by_setting_keys_decisions_and_refuses_two_owners():
    a, b = Decision.default("fetch", "land", "a", "storage"), Decision.default("pipeline", "p", "b")
    assert by_setting([a, b]) == {"fetch": a, "pipeline": b}
    with pytest.raises(ValueError, match=r"two decisions for 'fetch': storage and loader; one"):
        by_setting([a, Decision.default("fetch", "pull", "c", "loader")])
    with pytest.raises(ValueError, match=r"two decisions for 'fetch': \? and \?"):
        by_setting([Decision.default("fetch", "x", "a"), Decision.default("fetch", "y", "b")])


def test_how_sure_a_timed_choice_is_reads_back_typed_from_the_table():
    from diag.decision import read

    d = Decision.from_rows("micro_batch", 4, "resolved (2.00x, 6 + 5 samples, spread 3% / 5%)",
                           [{"micro_batch": 4}], source="accum", samples=[6, 5],
                           spread=[0.03, 0.05], resolved=True, tied=[2], repeats_s=1.25)
    kept = Decision.from_rows("pipeline", "naive", "within noise", [{}], source="loader",
                              resolved=False, repeats_s=float("nan"))
    back = read(frame([d, kept]))
    assert back == (d, kept) and (back[0].samples, back[0].tied) == ((6, 5), (2,))
    assert back[1].resolved is False and back[1].repeats_s is None and back[1].samples == ()
