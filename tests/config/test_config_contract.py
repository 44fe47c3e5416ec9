"""diag.config's validators at their edges: every message in full, every boundary value.

Written against the mutants `make mutate` found untested (docs/mutation.md). Each config is built
directly, so these run in milliseconds and need no experiment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from diag.config import (DiagnoseConfig, ExperimentConfig, InfoConfig, ModelLoadConfig,
                         QLoraConfig, ReportConfig, StorageConfig, ToyConfig, diag_home,
                         quick_mode)


@dataclass
class _Sizes(ExperimentConfig):
    """A config with a list and a path field."""

    sizes: Any = field(default_factory=lambda: [1, 2])  # values of a sweep
    folder: Path = Path("/tmp")  # a path field: to_dict() writes it as text


ALLOWED = ("expected s3://bucket/key or s3://bucket/prefix/, hf://datasets/org/name[@rev]/path, "
           "a local file or folder of shards, or '' for the embedded server")


def _raises(message: str, build: Any, **kwargs: Any) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        build(**kwargs)


def test_to_dict_writes_tuples_as_lists_and_paths_as_text() -> None:
    assert _Sizes(sizes=(1,)).to_dict() == {"sizes": [1], "folder": "/tmp"}


def test_replace_validates_the_new_values() -> None:
    cfg = ToyConfig.quick()
    assert cfg.replace(steps=7).steps == 7 and cfg.replace(steps=7).width == cfg.width
    _raises("ToyConfig.steps=0: must be a number > 0", cfg.replace, steps=0)


def test_report_config_needs_a_folder() -> None:
    assert ReportConfig(folder="runs/x").folder == "runs/x"
    _raises("ReportConfig.folder='': name a run folder (e.g. runs/<timestamp>)", ReportConfig)


def test_model_load_config_scenarios() -> None:
    assert ModelLoadConfig().scenarios == ["fresh", "cached", "cached_offline", "cached_cold"]
    assert ModelLoadConfig(scenarios=" cached , fresh,").scenarios == ["cached", "fresh"]
    assert ModelLoadConfig(scenarios=["cached_cold"]).scenarios == ["cached_cold"]
    once = ("ModelLoadConfig.scenarios={!r}: name each scenario once: fresh, cached, "
            "cached_offline, cached_cold")
    _raises(once.format([]), ModelLoadConfig, scenarios=[])
    _raises(once.format([]), ModelLoadConfig, scenarios=" , ")
    _raises(once.format(["fresh", "fresh"]), ModelLoadConfig, scenarios="fresh,fresh")
    _raises("ModelLoadConfig.scenarios: 'warm' is not a scenario; allowed values are 'fresh', "
            "'cached', 'cached_offline', 'cached_cold'", ModelLoadConfig,
            scenarios=["fresh", "warm"])
    _raises("ModelLoadConfig.revision='': name a branch, tag or commit (main)", ModelLoadConfig,
            revision="")


@pytest.mark.parametrize("name, bad, rule", [
    ("repeats", 0, "must be a number > 0"), ("timeout_s", -1.0, "must be a number > 0"),
    ("device", "tpu", "allowed values are 'auto', 'cpu', 'cuda' and 'cuda:N'"),
])
def test_model_load_config_numbers_and_device(name: str, bad: Any, rule: str) -> None:
    _raises(f"ModelLoadConfig.{name}={bad!r}: {rule}", ModelLoadConfig, **{name: bad})


@pytest.mark.parametrize("name, bad, rule", [
    ("steps", 0, "must be a number > 0"), ("prep_ms", -0.5, "must be a number >= 0"),
    ("naive_workers", -1, "must be a number >= 0"),
    ("optimized_workers", -2, "must be a number >= 0"),
    ("device", "cuda:x", "allowed values are 'auto', 'cpu', 'cuda' and 'cuda:N'"),
])
def test_diagnose_config_rules(name: str, bad: Any, rule: str) -> None:
    _raises(f"DiagnoseConfig.{name}={bad!r}: {rule}", DiagnoseConfig, **{name: bad})


def test_gpus_are_ones_the_amdahl_curve_can_mark() -> None:
    assert DiagnoseConfig(target_gpu="NVIDIA H200", current_gpu="").target_gpu == "NVIDIA H200"
    for flag, bad in (("target_gpu", "GTX 9999"), ("current_gpu", "Tesla T4")):  # T4: no bf16
        with pytest.raises(ValueError, match=rf"^--{flag.replace('_', '-')}={bad!r}: not a GPU "
                                             r"with a dense bf16 peak in diag's table; allowed: "
                                             r"B200, H200 SXM"):
            DiagnoseConfig(**{flag: bad})


def test_zero_is_allowed_where_the_rule_is_non_negative() -> None:
    cfg = DiagnoseConfig(prep_ms=0.0, naive_workers=0, optimized_workers=0, device="cuda:0")
    assert (cfg.prep_ms, cfg.optimized_workers, cfg.device) == (0.0, 0, "cuda:0")
    assert StorageConfig(warmup=0, retries=0, usd_per_hour=0.0).retries == 0


@pytest.mark.parametrize("name, bad, rule", [
    ("size_mb", 0.0, "must be a number > 0"), ("shards", False, "must be a number > 0"),
    ("repeats", "3", "must be a number > 0"), ("warmup", -1, "must be a number >= 0"),
    ("retries", True, "must be a number >= 0"), ("dataset_gb", "1", "must be a number >= 0"),
    ("runs_per_week", -1.0, "must be a number >= 0"),
    ("usd_per_hour", -0.5, "must be a number >= 0"),
    ("verify", "md5", "allowed values are 'sha256', 'size'"),
    ("source", "s3:///key", "no bucket; " + ALLOWED),
    ("source", "gs://b/k", "no such file or folder; " + ALLOWED),
    ("source", "hf://datasets/org", "a hub source is hf://datasets/org/name[@revision]/path "
                                    "(a dataset repo); " + ALLOWED),
    ("stall_s", 0, "must be a number > 0"),
])
def test_storage_config_rules(name: str, bad: Any, rule: str) -> None:
    _raises(f"StorageConfig.{name}={bad!r}: {rule}", StorageConfig, **{name: bad})


@pytest.mark.parametrize("name, bad, rule", [
    ("steps", 0, "must be a number > 0"), ("batch_size", 0, "must be a number > 0"),
    ("width", -8, "must be a number > 0"), ("warmup_steps", -1, "must be a number >= 0"),
    ("prep_ms", -1.0, "must be a number >= 0"), ("num_workers", -2, "must be a number >= 0"),
])
def test_toy_config_rules(name: str, bad: Any, rule: str) -> None:
    _raises(f"ToyConfig.{name}={bad!r}: {rule}", ToyConfig, **{name: bad})


def test_info_and_toy_edges() -> None:
    assert InfoConfig(probe_size=1).probe_size == 1
    assert ToyConfig(steps=1, warmup_steps=0, prep_ms=0.0, num_workers=0).steps == 1
    _raises("InfoConfig.probe_size=0.0: must be a number > 0", InfoConfig, probe_size=0.0)
    assert StorageConfig(source="s3://b/k").source == "s3://b/k"


@pytest.mark.parametrize("value, quick", [("", False), ("0", False), ("false", False),
                                          (" No ", False), ("1", True), ("yes", True)])
def test_quick_mode_values(monkeypatch: pytest.MonkeyPatch, value: str, quick: bool) -> None:
    monkeypatch.setenv("DIAG_QUICK", value)
    assert quick_mode() is quick


def test_quick_mode_unset_and_diag_home_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIAG_QUICK", raising=False)
    assert quick_mode() is False
    monkeypatch.delenv("DIAG_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)  # conftest points it into a temp folder
    assert diag_home() == Path.home() / ".cache" / "diag"
    monkeypatch.setenv("DIAG_HOME", "~/elsewhere")
    assert diag_home() == Path.home() / "elsewhere"


@pytest.mark.parametrize("name, bad, rule", [
    ("plan", "fast", "allowed values are 'naive', 'optimized', 'both'"),
    ("on_error", "ignore", "allowed values are 'raise', 'skip'"),
    ("records", 0, "must be a number > 0"), ("steps", 0, "must be a number > 0"),
    ("seq_len", 0, "must be a number > 0"), ("lr", 0.0, "must be a number > 0"),
    ("lora_r", 0, "must be a number > 0"), ("lora_alpha", -1, "must be a number > 0"),
    ("warmup_steps", -1, "must be a number >= 0"), ("lora_dropout", -0.1, "must be a number >= 0"),
    ("checkpoint_every", -1, "must be a number >= 0"), ("seed", -1, "must be a number >= 0"),
    ("device", "tpu", "allowed values are 'auto', 'cpu', 'cuda' and 'cuda:N'"),
    ("lora_dropout", 1.0, "must be in [0, 1)"),
    ("steps", 129, "at most records=128 (each optimizer step needs at least one record)"),
    ("warmup_steps", 8, "must be below steps=8, so some steps are measured in steady state"),
    ("source", "s3:///k.jsonl", "no bucket; " + ALLOWED),
    ("source", "data/no-such.jsonl", "no such file or folder; " + ALLOWED),
])
def test_qlora_config_rules(name: str, bad: Any, rule: str) -> None:
    shown = bad if name in ("steps", "warmup_steps") and "steps=" in rule else repr(bad)
    _raises(f"QLoraConfig.{name}={shown}: {rule}", QLoraConfig, **{name: bad})


def test_qlora_config_edges_that_are_allowed() -> None:
    cfg = QLoraConfig(records=4, steps=4, warmup_steps=3, lora_dropout=0.0, seed=0,
                      checkpoint_every=0, source="s3://b/data.jsonl", device="cuda:1")
    assert (cfg.steps, cfg.warmup_steps, cfg.source) == (4, 3, "s3://b/data.jsonl")
    assert QLoraConfig(lora_dropout=0.99).lora_dropout == 0.99
