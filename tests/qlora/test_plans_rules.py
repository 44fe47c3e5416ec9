"""diag.qlora.plans, one rule per test: the naive plan, collecting decisions, the owners'
defaults, the workers=0 caps, the CPU fallback for pin_memory, fitting the micro-batch
(constructed decisions; no experiment runs)."""

from __future__ import annotations

import pandas as pd
import pytest

from diag.decision import Decision
from diag.qlora.plans import SETTINGS, Plan, fit_micro_batch


def _measured(setting, value, source="test"):
    return Decision.from_rows(setting, value, f"{setting} measured", [{"x": 1}], source=source)


def _all(**values):
    """One measured decision per setting, the given values over a GPU-shaped plan."""
    base = {"fetch": "land", "model_cache": "persistent", "pipeline": "packed",
            "num_workers": 2, "pin_memory": True, "persistent_workers": True,
            "prefetch_factor": 4, "micro_batch": 8, "gradient_checkpointing": False} | values
    return [_measured(s, base[s]) for s in SETTINGS]


def test_the_naive_plan_is_every_library_default_labelled():
    plan = Plan.naive()
    assert plan.name == "naive"
    assert plan.settings() == {"name": "naive", "fetch": "pull", "model_cache": "empty",
                               "pipeline": "naive", "num_workers": 0, "pin_memory": False,
                               "persistent_workers": False, "prefetch_factor": None,
                               "micro_batch": 1, "gradient_checkpointing": True}
    assert [d.setting for d in plan.decisions] == list(SETTINGS)
    assert {(d.basis, d.source) for d in plan.decisions} == {("default", "naive")}
    first = "default: the default a first run gets: "
    assert {d.setting: d.evidence() for d in plan.decisions} == {
        "fetch": first + "the dataset copied from the object store per run",
        "model_cache": first + "a fresh container, an empty HF cache",
        "pipeline": first + "tokenize in __getitem__, pad to seq_len",
        "num_workers": first + "DataLoader num_workers=0",
        "pin_memory": first + "DataLoader pin_memory=False",
        "persistent_workers": first + "DataLoader persistent_workers=False",
        "prefetch_factor": first + "no workers, nothing prefetched",
        "micro_batch": first + "micro-batch 1, many accumulation steps",
        "gradient_checkpointing": "default: prepare_model_for_kbit_training turns it on"}
    assert plan.notes == ()


def test_collect_takes_each_decisions_value_in_settings_order():
    decisions = _all()
    plan = Plan.collect("mine", reversed(decisions))
    assert plan.name == "mine" and plan.decisions == tuple(decisions)
    assert (plan.num_workers, plan.prefetch_factor, plan.persistent_workers) == (2, 4, True)
    assert plan.decision("prefetch_factor").basis == "measured"


def test_collect_refuses_a_plan_with_a_setting_undecided():
    with pytest.raises(ValueError, match=r"Plan 'x': no decision for fetch, micro_batch$"):
        Plan.collect("x", [d for d in _all() if d.setting not in ("fetch", "micro_batch")])


def test_no_workers_caps_persistent_workers_and_prefetch_out_loud():
    plan = Plan.collect("p", _all(num_workers=0))
    assert (plan.persistent_workers, plan.prefetch_factor) == (False, None)
    for s in ("persistent_workers", "prefetch_factor"):
        d = plan.decision(s)
        assert d.basis == "capped" and d.why.endswith("num_workers=0 (no worker to keep or "
                                                      "prefetch)")
    assert plan.decision("persistent_workers").value is False
    assert plan.decision("prefetch_factor").value is None
    assert plan.decision("pin_memory").basis == "measured"  # not a worker setting
    already = Plan.collect("p", _all(num_workers=0, persistent_workers=False,
                                     prefetch_factor=None))
    assert {already.decision(s).basis for s in ("persistent_workers", "prefetch_factor")} == {
        "measured"}


def test_optimized_fills_what_nobody_decided_with_the_owners_default():
    plan = Plan.optimized([_measured("micro_batch", 4, "accum")], device="cuda:0")
    assert plan.name == "optimized" and plan.micro_batch == 4
    assert plan.decision("micro_batch").basis == "measured"
    others = [d for d in plan.decisions if d.setting != "micro_batch"]
    assert {d.basis for d in others} == {"default"}
    assert plan.decision("fetch").source == "storage" and plan.fetch == "land"
    assert plan.decision("gradient_checkpointing").value is True  # CUDA's default: on
    full = Plan.optimized(_all(), device="cuda")
    assert full.decisions == tuple(_all()) and full.notes == ()


def test_optimized_takes_an_experiments_decisions_and_the_owners_defaults_for_the_device():
    from diag.storage import decide

    storage = pd.DataFrame({"method": ["boto3_default", "land"], "cache_state": ["cold", "hit"],
                            "seconds": [9.0, 0.3]})
    plan = Plan.optimized(decide(storage), device="cuda")
    assert plan.decision("fetch").basis == "measured" and plan.fetch == "land"
    assert plan.decision("model_cache").basis == "default"
    assert plan.gradient_checkpointing is True  # the device reaches the owners: CUDA's default
    assert Plan.optimized(decide(storage)).gradient_checkpointing is False  # CPU's


def test_pin_memory_on_a_cpu_is_capped_with_a_note():
    gpu = Plan.optimized(_all(), device="cuda:1")
    assert gpu.pin_memory is True and gpu.notes == ()
    cpu = Plan.optimized(_all(), device="cpu")
    assert cpu.pin_memory is False and cpu.decision("pin_memory").basis == "capped"
    assert cpu.decision("pin_memory").why.endswith("capped to False: no CUDA device")
    assert cpu.notes == ("pin_memory=True needs CUDA (page-locked memory for async "
                         "host-to-device copies); on CPU the batch already is in host memory, "
                         "so pin_memory=False is the equivalent",)
    assert cpu.for_device("cpu") is cpu  # nothing left to cap
    assert cpu.num_workers == 2 and cpu.decision("num_workers").basis == "measured"


def test_fit_takes_the_largest_divisor_at_most_the_decided_micro_batch():
    assert [fit_micro_batch(12, m) for m in (1, 5, 6, 16)] == [1, 4, 6, 12]
    assert fit_micro_batch(7, 4) == 1 and fit_micro_batch(1, 8) == 1 and fit_micro_batch(0, 4) == 1
    plan = Plan.optimized(_all(micro_batch=16), device="cuda").fit(24)
    d = plan.decision("micro_batch")
    assert plan.micro_batch == 12 and d.value == 12 and d.basis == "capped"
    assert d.why.endswith("capped to 12: the job has 24 rows per optimizer step; 12 is the "
                          "largest micro-batch <= 16 that divides them")
    assert plan.notes == ()
    fits = Plan.optimized(_all(micro_batch=8), device="cuda").fit(32)
    assert fits.micro_batch == 8 and fits.decision("micro_batch").basis == "measured"


def test_the_frame_shows_each_setting_its_basis_and_evidence():
    plan = Plan.optimized(_all(), device="cpu")
    f = plan.frame()
    assert list(f.columns) == ["run", "setting", "value", "basis", "evidence"]
    assert list(f["setting"]) == list(SETTINGS) and set(f["run"]) == {"optimized"}
    row = f.set_index("setting").loc["pin_memory"]
    assert (row["value"], row["basis"]) == ("False", "capped")
    assert row["evidence"] == plan.decision("pin_memory").evidence()
    assert (f["setting"][0], f["evidence"][0]) == ("fetch", "measured: fetch measured")
