"""diag.qlora.plans, one rule per test: the naive plan, collecting decisions, the workers=0 caps,
the CPU fallback for pin_memory, fitting the micro-batch, and which frame feeds which rule
(constructed decisions and frames; no experiment runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from diag.decision import Decision
from diag.qlora.plans import SETTINGS, Plan, decide_frames, fit_micro_batch


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
    assert dict(plan.evidence) == {
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


def test_optimized_decides_a_mapping_of_frames_by_each_rule():
    storage = pd.DataFrame({"method": ["boto3_default", "land"], "cache_state": ["cold", "hit"],
                            "seconds": [9.0, 0.3]})
    plan = Plan.optimized({"storage": storage}, device="cuda")
    assert plan.decision("fetch").basis == "measured" and plan.fetch == "land"
    assert plan.decision("model_cache").basis == "default"
    assert plan.gradient_checkpointing is True  # the device reaches the rules: CUDA's default
    assert Plan.optimized({"storage": storage}).gradient_checkpointing is False  # CPU's


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
    assert plan.evidence[0] == ("fetch", "measured: fetch measured")


def test_decide_frames_reads_results_frames_sweeps_summaries_and_their_decisions():
    loader = pd.DataFrame([{"pipeline": "packed", "num_workers": w, "pin_memory": True,
                            "persistent_workers": w > 0, "prefetch_factor": 2 if w else None,
                            "samples_per_s": 100.0, "tokens_per_s": 400.0, "data_wait_s": wait,
                            "step_s": 0.02, "data_wait_share": wait / (wait + 0.02),
                            "batch_size": 8, "error": ""} for w, wait in ((0, 0.03), (1, 0.0))])
    accum = pd.DataFrame({"micro_batch": [1, 4, 4], "grad_accum": [4, 1, 1],
                          "tokens_per_step": [64] * 3, "status": ["ok"] * 3,
                          "seconds_per_step": [2.0, 1.0, 1.0], "tokens_per_s": [32.0, 64.0, 64.0],
                          "data_s": [0.0] * 3, "compute_s": [1.0] * 3, "mfu": [0.1] * 3,
                          "floor_s": [0.1] * 3, "peak_mem_gb": [1.0] * 3, "warmup_s": [0.0] * 3,
                          "compile": [False] * 3, "detail": [""] * 3, "repeat": [0, 0, 1]})
    own = (_measured("gradient_checkpointing", False, "checkpointing"),)
    got = {d.setting: d for d in decide_frames({
        "loader": SimpleNamespace(sweep=loader),  # a result object: its sweep
        "accum": accum,  # the sweep frame: summarized first
        "checkpointing": SimpleNamespace(decisions=own, frame=None)}, device="cuda")}
    assert (got["num_workers"].value, got["num_workers"].basis) == (1, "measured")
    assert (got["micro_batch"].value, got["micro_batch"].basis) == (4, "measured")
    assert got["gradient_checkpointing"] is own[0]
    assert got["fetch"].basis == got["model_cache"].basis == "default"
    assert set(got) == set(SETTINGS)
    load = pd.DataFrame({"scenario": ["fresh", "cached"], "part": ["load_model"] * 2,
                         "seconds": [30.0, 3.0], "model": ["m"] * 2, "device": ["cpu"] * 2})
    ckpt = pd.DataFrame({"gradient_checkpointing": [True, False], "seconds": [1.3, 1.0],
                         "peak_mem_gb": [1e-6, 2e-6]})  # fits anywhere: off, measured
    accum_own = (_measured("micro_batch", 8, "accum"),)
    got = {d.setting: d for d in decide_frames({"model_load": load, "checkpointing": ckpt,
                                                "accum": SimpleNamespace(decisions=accum_own,
                                                                         summary=None)})}
    assert (got["model_cache"].basis, got["model_cache"].baseline_s) == ("measured", 30.0)
    assert got["micro_batch"] is accum_own[0]
    assert (got["gradient_checkpointing"].value,
            got["gradient_checkpointing"].basis) == (False, "measured")
    summary = SimpleNamespace(summary=pd.DataFrame({
        "micro_batch": [2], "grad_accum": [2], "status": ["ok"], "tokens_per_s": [9.0],
        "seconds_per_step": [1.0], "recommended": [True]}))
    loader_own = (_measured("num_workers", 3, "loader"),)
    got = {d.setting: d for d in decide_frames({"accum": summary,
                                                "loader": SimpleNamespace(decisions=loader_own),
                                                "storage": SimpleNamespace(frame=None)})}
    assert got["micro_batch"].value == 2 and got["num_workers"] is loader_own[0]
    assert got["gradient_checkpointing"].value is False  # CPU's default: off
    assert got["fetch"].basis == "default"
