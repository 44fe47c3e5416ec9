"""The loader, accum and storage configs' rules at their edges, and diag_home's XDG fallback.

Written against the mutants `make mutate` found untested after diag/config became a package
(docs/mutation.md). Each config is built directly: milliseconds, no experiment runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from diag import secrets
from diag.config import ACCUM_MODELS, AccumConfig, LoaderConfig, StorageConfig, diag_home
from diag.config.accum import check_divides


def _raises(message: str, build: Any, **kwargs: Any) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        build(**kwargs)


@pytest.mark.parametrize("name, rule", [
    ("model_params_b", "must be a number > 0"), ("timeout_s", "must be a number > 0"),
    ("mfu", "must be a number in (0, 1)"), ("target_share", "must be a number in (0, 1)")])
def test_loader_positive_fields(name: str, rule: str) -> None:
    _raises(f"LoaderConfig.{name}=0: {rule}", LoaderConfig, **{name: 0})


@pytest.mark.parametrize("name", ["batch_size", "steps", "repeats", "prefetch_factor",
                                  "run_steps", "profile_samples", "num_proc"])
def test_loader_whole_number_fields(name: str) -> None:
    for bad in (0, 2.5):
        _raises(f"LoaderConfig.{name}={bad}: must be a whole number >= 1", LoaderConfig,
                **{name: bad})


@pytest.mark.parametrize("name, bad, rule", [
    ("step_ms", -1.0, "must be a number >= 0"), ("extra_prep_ms", -0.5, "must be a number >= 0"),
    ("consumer", "gpu", "allowed values are 'emulated', 'model'"),
    ("on_error", "warn", "allowed values are 'raise', 'skip'"),
    ("device", "tpu", "allowed values are 'auto', 'cpu', 'cuda' and 'cuda:N'"),
    ("seq_len", 1, "must be a whole number >= 2"), ("seq_len", 64.0, "must be a whole number >= 2"),
    ("seq_len", True, "must be a whole number >= 2"),
    ("mfu", 1.0, "must be a number in (0, 1)"),
    ("target_share", 1.5, "must be a number in (0, 1)"),
    ("workers", [], "must be a list of different whole numbers >= 0 (num_workers values)"),
    ("workers", "0,1", "must be a list of different whole numbers >= 0 (num_workers values)"),
    ("workers", [0, 0], "must be a list of different whole numbers >= 0 (num_workers values)"),
    ("workers", [0, -1], "must be a list of different whole numbers >= 0 (num_workers values)"),
    ("workers", [0, 1.0], "must be a list of different whole numbers >= 0 (num_workers values)"),
    ("workers", [False, 1], "must be a list of different whole numbers >= 0 (num_workers values)"),
])
def test_loader_config_rules(name: str, bad: Any, rule: str) -> None:
    _raises(f"LoaderConfig.{name}={bad!r}: {rule}", LoaderConfig, **{name: bad})


def test_loader_pipelines_parsed_and_checked() -> None:
    every = LoaderConfig().pipelines
    assert LoaderConfig(pipelines=f" {every[0]} ,, {every[-1]} ").pipelines == [every[0], every[-1]]
    allowed = ", ".join(map(repr, every))
    _raises(f"LoaderConfig.pipelines=[]: name one or more of {allowed}", LoaderConfig,
            pipelines=" , ")
    _raises(f"LoaderConfig.pipelines=['{every[0]}', 'fast']: name one or more of {allowed}",
            LoaderConfig, pipelines=[every[0], "fast"])


def test_loader_edges_that_are_allowed() -> None:
    cfg = LoaderConfig(seq_len=2, workers=(0, 3), step_ms=0.0, extra_prep_ms=0.0, mfu=0.99,
                       target_share=0.5, device="cuda:0")
    assert (cfg.seq_len, cfg.workers, cfg.mfu) == (2, (0, 3), 0.99)


@pytest.mark.parametrize("overrides, message", [
    ({"tokens_per_step": 0}, "AccumConfig.tokens_per_step=0: must be a whole number >= 1"),
    ({"seq_len": 0}, "AccumConfig.seq_len=0: must be a whole number >= 1"),
    ({"steps": 0}, "AccumConfig.steps=0: must be a whole number >= 1"),
    ({"steps_per_run": 0}, "AccumConfig.steps_per_run=0: must be a whole number >= 1"),
    ({"warmup_steps": -1}, "AccumConfig.warmup_steps=-1: must be a whole number >= 0"),
    ({"peak_tflops": -1.0}, "AccumConfig.peak_tflops=-1.0: must be a number >= 0"),
    ({"seed": -1}, "AccumConfig.seed=-1: must be a whole number >= 0"),
    ({"tokens_per_step": 4096.0}, "AccumConfig.tokens_per_step=4096.0: must be a whole number "
     ">= 1"),
    ({"seq_len": 128.0}, "AccumConfig.seq_len=128.0: must be a whole number >= 1"),
    ({"steps": 3.0}, "AccumConfig.steps=3.0: must be a whole number >= 1"),
    ({"warmup_steps": 1.0}, "AccumConfig.warmup_steps=1.0: must be a whole number >= 0"),
    ({"steps_per_run": 9.5}, "AccumConfig.steps_per_run=9.5: must be a whole number >= 1"),
    ({"compile": True, "warmup_steps": 0}, "AccumConfig.warmup_steps=0: compile=True needs >= 1 "
     "warm-up step, where the compile happens (it must not land in the timed steps)"),
    ({"model": "gpt3"}, "AccumConfig.model='gpt3': allowed values are 'tiny', 'gpt2-small'"),
    ({"dtype": "fp8"}, "AccumConfig.dtype='fp8': allowed values are 'auto', 'bf16', "
     "'fp32'"),
    ({"device": "tpu"}, "AccumConfig.device='tpu': allowed values are 'auto', 'cpu', 'cuda' and "
     "'cuda:N'"),
    ({"tokens_per_step": 4000}, "AccumConfig.tokens_per_step=4000: not divisible by seq_len=128; "
     "allowed: a multiple of it, e.g. 3968"),
    ({"tokens_per_step": 100}, "AccumConfig.tokens_per_step=100: not divisible by seq_len=128; "
     "allowed: a multiple of it, e.g. 128"),
    ({"micro_batches": [3]}, "AccumConfig.micro_batches: 3 x seq_len=128 does not divide "
     "tokens_per_step=4096; allowed micro-batches: 1, 2, 4, 8, 16, 32"),
    ({"micro_batches": [True]}, "AccumConfig.micro_batches: True x seq_len=128 does not divide "
     "tokens_per_step=4096; allowed micro-batches: 1, 2, 4, 8, 16, 32"),
    ({"micro_batches": [64]}, "AccumConfig.micro_batches: 64 x seq_len=128 does not divide "
     "tokens_per_step=4096; allowed micro-batches: 1, 2, 4, 8, 16, 32"),
])
def test_accum_config_rules(overrides: dict[str, Any], message: str) -> None:
    _raises(message, AccumConfig, **overrides)


def test_accum_context_and_allowed_edges() -> None:
    cfg = AccumConfig(micro_batches=" 1, 32,", compile=True, warmup_steps=1, peak_tflops=0.0)
    assert cfg.micro_batches == [1, 32]
    context = ACCUM_MODELS["tiny"]  # a sequence may fill the whole context, not more
    assert AccumConfig(model="tiny", seq_len=context, tokens_per_step=context).seq_len == context
    too_long = 1 << 20
    with pytest.raises(ValueError, match=r"^AccumConfig\.seq_len=1048576: above the context of "
                       r"model 'tiny' \(\d+ positions\); allowed 1\.\.\d+$"):
        AccumConfig(seq_len=too_long, tokens_per_step=too_long)


def test_accum_micro_batches_are_checked_against_the_launchers_world(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 4096 / 128 = 32 sequences: at WORLD_SIZE=4 micro-batch 8 fills a rank (4 x 8 = 32), 16
    # would need 64; every rank checks this before it imports torch or dials the rendezvous
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert AccumConfig(micro_batches=[1, 8]).micro_batches == [1, 8]
    _raises("AccumConfig.tokens_per_step=4096 (32 sequences of 128) is not divisible by world "
            "size 4 x micro-batch 16 = 64; micro-batches that divide it at this world size: 1, "
            "2, 4, 8", AccumConfig, micro_batches=[8, 16])
    monkeypatch.setenv("WORLD_SIZE", "3")
    _raises("AccumConfig.tokens_per_step=4096 (32 sequences of 128) is not divisible by world "
            "size 3 x micro-batch 1 = 3; micro-batches that divide it at this world size: none "
            "(make AccumConfig.tokens_per_step a multiple of 384)", AccumConfig,
            micro_batches=[1])
    monkeypatch.setenv("WORLD_SIZE", "2")  # the smallest world that splits a step
    _raises("AccumConfig.tokens_per_step=4096 (32 sequences of 128) is not divisible by world "
            "size 2 x micro-batch 32 = 64; micro-batches that divide it at this world size: 1, "
            "2, 4, 8, 16", AccumConfig, micro_batches=[32])
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: every divisor of the step is allowed
    assert AccumConfig(micro_batches=[32]).micro_batches == [32]
    monkeypatch.setenv("WORLD_SIZE", "two")  # diag.timing.distributed names it when the rank joins
    assert AccumConfig(micro_batches=[32]).micro_batches == [32]


def test_check_divides_names_tokens_per_step_unless_told_another_field() -> None:
    _raises("tokens_per_step=4096 (32 sequences of 128) is not divisible by world size 3 x "
            "micro-batch 2 = 6; micro-batches that divide it at this world size: none (make "
            "tokens_per_step a multiple of 384)", check_divides, tokens_per_step=4096,
            seq_len=128, micro_batch=2, world_size=3)


@pytest.mark.parametrize("overrides, flag", [
    ({"endpoint_url": "http://minio:9000"}, "--endpoint-url"), ({"profile": "team"}, "--profile"),
    ({"region": "eu-west-1"}, "--region"), ({"sign_request": False}, "--no-sign-request"),
])
def test_storage_source_flags_need_a_source(overrides: dict[str, Any], flag: str) -> None:
    _raises(f"StorageConfig.source is empty but {flag} is given: the run would use the embedded "
            f"server and ignore {flag}; name your object with --source s3://bucket/key (or drop "
            f"{flag})", StorageConfig, **overrides)
    assert StorageConfig(source="s3://b/k", **overrides).source == "s3://b/k"


def test_storage_endpoint_password_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(secrets, "_registered", set())
    StorageConfig(source="s3://b/k", endpoint_url="http://user:pw-in-url-9@minio:9000")
    assert secrets.redact("auth failed for pw-in-url-9") == "auth failed for ***"


def test_diag_home_follows_an_absolute_xdg_cache_home(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.delenv("DIAG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert diag_home() == tmp_path / "xdg" / "diag"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: the spec says ignore
    assert diag_home() == tmp_path / "home" / ".cache" / "diag"


@pytest.mark.parametrize("steps, eval_records", [(60, 5), (60, 48), (1875, 300), (10, 5),
                                                 (400, 120)])
def test_the_default_eval_cadence_keeps_eval_under_a_tenth_of_the_training(steps, eval_records):
    from diag.config import TrainConfig

    cfg = TrainConfig.default(quick=False)
    every = cfg.eval_cadence(steps, eval_records)
    evals = steps // every + 2  # before the first step, every `every`, at the end
    # an eval record runs forward only: a third of a trained one
    assert evals * eval_records / 3 <= 0.1 * steps * cfg.batch_size + 1e-9
    assert every <= max(1, steps // 10) or evals <= 12  # never rarer than it needs to be
    assert TrainConfig.default(quick=False, eval_every=7).eval_cadence(steps, eval_records) == 7
