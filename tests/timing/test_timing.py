import time

import pandas as pd
import pytest

from diag.timing import STAGES, StageTimer, check_stage


def test_stage_accumulates_and_frame_is_tidy():
    timer = StageTimer()
    begin = time.perf_counter()
    for _ in range(3):
        with timer.stage("compute"):
            time.sleep(0.01)
    middle = time.perf_counter()
    with timer.stage("load_model"):
        time.sleep(0.02)
    end = time.perf_counter()
    frame = timer.to_frame()
    assert list(frame.columns) == ["stage", "seconds", "step", "rank", "node"]
    assert (frame["stage"] == "compute").sum() == 3
    # each at least its sleeps, at most the wall around them (a busy box oversleeps)
    assert 0.03 <= timer.total("compute") <= middle - begin
    assert 0.02 <= timer.total("load_model") <= end - middle
    assert frame["step"].isna().all()  # no watch(): no step numbers
    assert (frame["rank"] == 0).all()


def test_decorator_form_times_each_call():
    timer = StageTimer()

    @timer.stage("preprocess")
    def work(n):
        time.sleep(0.005)
        return n * 2

    assert [work(i) for i in range(4)] == [0, 2, 4, 6]
    frame = timer.to_frame()
    assert len(frame) == 4 and set(frame["stage"]) == {"preprocess"}
    assert (frame["seconds"] >= 0.004).all()


def test_decorator_on_recursive_function_keeps_each_interval():
    timer = StageTimer()

    @timer.stage("other")
    def depth(n):
        time.sleep(0.002)
        return 0 if n == 0 else 1 + depth(n - 1)

    assert depth(3) == 3
    seconds = timer.to_frame()["seconds"].tolist()
    assert len(seconds) == 4
    assert seconds == sorted(seconds)  # inner calls finish first and are shorter


def test_stage_that_raises_is_still_recorded():
    timer = StageTimer()
    with pytest.raises(KeyError):
        with timer.stage("checkpoint"):
            time.sleep(0.01)
            raise KeyError("disk full")
    frame = timer.to_frame()
    assert frame["stage"].tolist() == ["checkpoint"]
    assert frame["seconds"].iloc[0] >= 0.009


def test_watch_bills_the_loaders_own_time_to_data_wait():
    # the loader clocks each of its own intervals (resumed -> handing the item over): each
    # data_wait holds the injected sleep (a load never shortens a sleep) and that interval, and
    # no more than the hand-over between the two clocks. A busy box's late wake-ups land in
    # both clocks alike, so they cannot fail it; 20 ms is far above a hand-over (microseconds)
    delay, own = 0.1, []

    def slow_loader():
        for i in range(3):
            start = time.perf_counter()
            time.sleep(delay)
            own.append(time.perf_counter() - start)
            yield i

    timer = StageTimer()
    seen = []
    for item in timer.watch(slow_loader()):
        with timer.stage("compute"):
            seen.append(item)
    assert seen == [0, 1, 2]
    frame = timer.to_frame()
    waits = frame[frame["stage"] == "data_wait"]
    assert waits["step"].tolist() == [0, 1, 2]
    for seconds, loader in zip(waits["seconds"], own):
        assert delay <= loader <= seconds <= loader + 0.02, (seconds, loader)
    compute = frame[frame["stage"] == "compute"]
    assert compute["step"].tolist() == [0, 1, 2]  # step-level stages carry the step


def test_watch_excludes_loop_body_time():
    timer = StageTimer()
    for _ in timer.watch(range(3)):
        time.sleep(0.02)  # the body is not data_wait
    waits = timer.to_frame().query("stage == 'data_wait'")["seconds"]
    assert (waits < 0.005).all()


def test_disabled_timer_records_nothing_and_passes_items_through():
    timer = StageTimer(enabled=False)
    with timer.stage("compute"):
        pass

    @timer.stage("compute")
    def f():
        return 7

    assert f() == 7
    assert list(timer.watch(iter([1, 2]))) == [1, 2]
    timer.record("compute", 1.0)
    assert timer.to_frame().empty


def test_unknown_stage_names_the_vocabulary():
    timer = StageTimer()
    with pytest.raises(ValueError, match="unknown stage 'fetch'.*fetch_data"):
        timer.stage("fetch")
    with pytest.raises(ValueError, match="durations must be >= 0"):
        timer.record("compute", -1.0)
    assert check_stage("h2d") == "h2d"
    assert {"fetch_data", "load_model", "data_wait", "h2d", "compute", "download"} <= set(STAGES)


def test_record_tags_step_level_stages_with_current_step():
    timer = StageTimer(rank=3)
    for _ in timer.watch(range(2)):
        timer.record("compute", 0.5)
    timer.record("eval", 1.5)
    frame = timer.to_frame()
    assert frame.query("stage == 'compute'")["step"].tolist() == [0, 1]
    assert pd.isna(frame.query("stage == 'eval'")["step"].iloc[0])
    assert (frame["rank"] == 3).all()


def test_cpu_device_does_not_sync():
    timer = StageTimer(device="cpu")
    assert timer._sync is None


def test_stage_after_the_watched_loop_has_no_step():
    timer = StageTimer()
    for _ in timer.watch(range(3)):
        timer.record("compute", 0.1)
    timer.record("h2d", 0.5)  # e.g. a final copy after the loop
    frame = timer.to_frame()
    assert pd.isna(frame.query("stage == 'h2d'")["step"].iloc[0])
    assert frame.query("stage == 'compute'")["step"].tolist() == [0, 1, 2]


@pytest.mark.gpu
def test_cuda_stage_waits_for_its_kernels():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    timer = StageTimer(device="cuda")
    torch.zeros(1, device="cuda")  # initialise the context outside the timed stage
    with timer.stage("compute"):
        torch.cuda._sleep(200_000_000)  # queued: returns at once, runs ~0.1 s on the GPU
    assert timer.total("compute") >= 0.05  # without a sync at the boundary this is ~0


def _gather_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        timer = StageTimer()  # rank comes from torch.distributed
        for _ in timer.watch(range(2 + rank)):
            timer.record("compute", 0.1 * (rank + 1))
        frame = timer.gather()
        assert frame.index.tolist() == list(range(len(frame)))  # one table, not two stacked
        if rank == 0:
            frame.to_csv(out, index=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gather_collects_every_rank_over_gloo(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "gathered.csv"
    mp.spawn(_gather_worker, args=(2, port, str(out)), nprocs=2, join=True)
    assert StageTimer().gather().empty  # no process group here: a timer's own (empty) frame
    frame = pd.read_csv(out)
    assert sorted(frame["rank"].unique()) == [0, 1]
    compute = frame[frame["stage"] == "compute"]
    assert compute.groupby("rank")["seconds"].sum().round(6).tolist() == [0.2, 0.6]
    assert frame[frame["stage"] == "data_wait"].groupby("rank").size().tolist() == [2, 3]


def test_stage_names_show_in_a_torch_profiler_trace(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    def loop(timer):
        with timer.stage("train"):
            for x in timer.watch([torch.ones(4)] * 2):
                with timer.stage("compute"):
                    (x @ x).item()

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loop(StageTimer())
    names = [e.name for e in prof.events()]
    assert names.count("compute") == 2 and names.count("data_wait") == 3  # 2 items + the end
    assert names.count("train") == 1
    prof.export_chrome_trace(str(tmp_path / "trace.json"))  # what Perfetto and HTA read
    assert '"name": "compute"' in (tmp_path / "trace.json").read_text()

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loop(StageTimer(trace=False))
    assert not {"compute", "data_wait", "train"} & {e.name for e in prof.events()}


def test_ranges_cost_nothing_without_a_profiler(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: calls.append(name))
    timer = StageTimer()
    with timer.stage("compute"):
        pass
    assert calls == [] and len(timer.to_frame()) == 1  # no profiler recording: no range made


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stages_push_and_pop_nvtx_ranges(monkeypatch):
    import torch

    pushed = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: pushed.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append("pop"))
    timer = StageTimer(device="cuda")
    with timer.stage("compute"):
        torch.ones(8, device="cuda").sum()
    assert pushed == ["compute", "pop"]
