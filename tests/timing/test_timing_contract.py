"""diag.timing's StageTimer at its edges: zero durations, explicit steps, totals per stage, and
exceptions through a disabled timer. Written against mutants `make mutate` found alive.
"""

from __future__ import annotations

import sys

import pytest

from diag.timing import StageTimer, check_stage


def test_record_keeps_zero_durations_and_explicit_steps() -> None:
    timer = StageTimer(rank=0)
    timer.record("compute", 0.0)  # a stage that took no measurable time is still a row
    timer.record("compute", 1.5, step=7)  # the caller's step wins outside watch()
    for _ in timer.watch(range(2)):
        timer.record("h2d", 0.25, step=40)  # ... and inside it
    frame = timer.to_frame()
    assert frame.query("stage == 'compute'")["seconds"].tolist() == [0.0, 1.5]
    assert frame.query("stage == 'compute'")["step"].tolist()[1] == 7
    assert frame.query("stage == 'h2d'")["step"].tolist() == [40, 40]


def test_total_sums_one_stage_only() -> None:
    timer = StageTimer()
    for stage, seconds in (("compute", 1.0), ("eval", 10.0), ("compute", 2.0)):
        timer.record(stage, seconds)
    assert timer.total("compute") == 3.0
    assert timer.total("eval") == 10.0
    assert timer.total("h2d") == 0


@pytest.mark.parametrize("enabled", [True, False])
def test_an_exception_inside_a_stage_is_never_swallowed(enabled: bool) -> None:
    timer = StageTimer(enabled=enabled)
    with pytest.raises(RuntimeError, match="out of memory"):
        with timer.stage("compute"):
            raise RuntimeError("out of memory")

    @timer.stage("eval")
    def fails() -> None:
        raise KeyError("split")

    with pytest.raises(KeyError):
        fails()
    assert len(timer.to_frame()) == (2 if enabled else 0)


def test_run_level_stages_inside_watch_carry_no_step_and_steps_are_int64() -> None:
    timer = StageTimer()
    for _ in timer.watch(range(2)):
        timer.record("eval", 0.5)  # run-level, even when timed inside the loop
        timer.record("compute", 0.5)
    frame = timer.to_frame()
    assert frame.query("stage == 'eval'")["step"].isna().all()
    assert str(frame["step"].dtype) == "Int64"


def test_unknown_stage_message_lists_every_group() -> None:
    with pytest.raises(ValueError) as err:
        check_stage("fetch")
    assert str(err.value) == (
        "unknown stage 'fetch': allowed stages are run-level fetch_data, load_model, preprocess, "
        "setup, warmup, train, checkpoint, eval; step-level data_wait, h2d, compute, comm_wait, "
        "other; "
        "load_model parts import, download, read, quantize, to_device, tokenizer")


def test_rank_comes_from_the_environment_without_a_process_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    assert StageTimer().rank == 5
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # as if torch were not installed
    assert StageTimer().rank == 5
    monkeypatch.delenv("RANK")
    assert StageTimer().rank == 0


def test_an_async_device_is_synced_at_every_stage_boundary(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from diag.machine import device as devices

    synced: list[object] = []
    monkeypatch.setattr(devices, "is_async", lambda device: True)
    monkeypatch.setattr(devices, "sync", lambda device=None: synced.append(device))
    # trace=False: this CPU build has no NVTX; the trace ranges have tests of their own
    timer = StageTimer(device="cuda:1", trace=False)
    with timer.stage("compute"):
        assert synced == ["cuda:1"]  # before the start: earlier kernels are not billed here
    assert synced == ["cuda:1", "cuda:1"]  # before the stop: this stage's kernels are


class _Ranges:
    """Stands in for torch.cuda.nvtx and torch.profiler.record_function: logs every push/pop."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str | None]] = []

    def range_push(self, name: str | None) -> None:
        self.log.append(("push", name))

    def range_pop(self) -> None:
        self.log.append(("pop", None))

    def record_function(self, name: str) -> object:
        ranges = self

        class _Range:
            def __enter__(self) -> None:
                ranges.log.append(("enter", name))

            def __exit__(self, *exc: object) -> None:
                ranges.log.append(("exit", name))

        return _Range()


def test_every_stage_opens_and_closes_its_named_trace_ranges(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NVTX needs a CUDA build, and a record_function left open still shows in a CPU trace; the
    # pairing is what Nsight and Perfetto read, so it is checked on stand-ins that log it
    import torch

    from diag.machine import device as devices

    ranges = _Ranges()
    monkeypatch.setattr(devices, "is_async", lambda device: True)
    monkeypatch.setattr(devices, "sync", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "nvtx", ranges)
    monkeypatch.setattr(torch.profiler, "record_function", ranges.record_function)
    monkeypatch.setattr(torch.autograd, "_profiler_enabled", lambda: True)
    timer = StageTimer(device="cuda", trace=True)
    for _ in timer.watch(range(1)):
        with timer.stage("compute"):
            pass
    assert ranges.log == [
        ("push", "data_wait"), ("enter", "data_wait"), ("exit", "data_wait"), ("pop", None),
        ("push", "compute"), ("enter", "compute"), ("exit", "compute"), ("pop", None),
        ("push", "data_wait"), ("enter", "data_wait"), ("exit", "data_wait"), ("pop", None),
    ]
    assert StageTimer(device="cuda", trace=False)._nvtx is None  # trace=False opens nothing


def test_median_seconds_filters_every_column_and_says_none_when_nothing_matches() -> None:
    import pandas as pd

    from diag.timing import median_seconds

    frame = pd.DataFrame({"method": ["land", "land", "land", "pull"],
                          "cache_state": ["hit", "hit", "miss", "remote"],
                          "seconds": [1.0, 3.0, 50.0, 9.0]})
    assert median_seconds(frame, method="land", cache_state="hit") == 2.0
    assert median_seconds(frame, method="land") == 3.0
    assert median_seconds(frame, method="s5cmd") is None
    assert median_seconds(frame, scenario="fresh") is None  # no such column
    assert median_seconds(None, method="land") is None
    assert median_seconds(frame.iloc[:0], method="land") is None
