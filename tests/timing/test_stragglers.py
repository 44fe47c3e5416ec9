"""Straggler findings and per-rank tables from constructed frames; the pieces of
diag.timing.distributed that need no second process (seat from the environment, spills,
divisibility, the timeouts and the fill's wait)."""

from __future__ import annotations

import pandas as pd
import pytest

from diag.timing import stragglers
from diag.config.accum import check_divides
from diag.timing.distributed import place
from diag.timing.distributed import read_spills
from diag.timing import StageTimer


def _frame(per_rank: dict[int, dict[str, float]], steps: int = 8, node_of=lambda r: 0):
    rows = []
    for rank, stages in per_rank.items():
        for step in range(steps):
            for stage, seconds in stages.items():
                rows.append({"stage": stage, "seconds": seconds, "step": step, "rank": rank,
                             "node": node_of(rank)})
        rows.append({"stage": "train", "seconds": 9.9, "step": None, "rank": rank,
                     "node": node_of(rank)})
    frame = pd.DataFrame(rows)
    frame["step"] = frame["step"].astype("Int64")
    return frame


def test_a_starved_loader_is_named_with_its_numbers_and_the_fix():
    frame = _frame({0: {"data_wait": 0.001, "compute": 0.010, "comm_wait": 0.052},
                    1: {"data_wait": 0.051, "compute": 0.010, "comm_wait": 0.002},
                    2: {"data_wait": 0.001, "compute": 0.011, "comm_wait": 0.051}},
                   node_of=lambda r: r // 2)
    found = stragglers.findings(frame, cores_per_node=16, workers_per_rank=8)
    assert len(found) == 1
    row = found.iloc[0]
    assert (row["ranks"], row["node"]) == ("1", 0)
    assert row["wait_per_step_s"] == pytest.approx(0.0495)  # median of 0.052, 0.051 - 0.002
    assert row["seconds_waited"] == pytest.approx(0.0495 * 16)  # 2 other ranks x 8 steps
    assert "loader is starved" in row["finding"]
    assert "16 cores / 2 ranks on node 0 = 8 per rank, now 8" in row["finding"]
    assert "slower in 8 of 8 steps" in row["evidence"]


def test_a_slow_device_is_not_blamed_on_the_loader():
    frame = _frame({0: {"data_wait": 0.001, "compute": 0.010, "comm_wait": 0.030},
                    1: {"data_wait": 0.001, "compute": 0.040, "comm_wait": 0.001}})
    row = stragglers.findings(frame).iloc[0]
    assert row["ranks"] == "1" and "computes" in row["finding"] and "loader" not in row["finding"]


def test_even_ranks_and_a_single_rank_name_no_straggler():
    even = _frame({0: {"data_wait": 0.001, "compute": 0.010, "comm_wait": 0.001},
                   1: {"data_wait": 0.001, "compute": 0.0105, "comm_wait": 0.001}})
    assert stragglers.findings(even).empty  # 5% apart: under Rule.share
    assert stragglers.findings(_frame({0: {"compute": 0.01}})).empty
    assert list(stragglers.findings(even).columns) == stragglers.FINDING_COLUMNS


def test_noise_is_no_straggler_the_floor_and_the_most_of_steps_decide():
    # what raised false alarms: 2-6 ms steps over gloo, one rank a little slower, or much
    # slower now and then (pre-empted): 7 of 20 steps
    small = _frame({0: {"data_wait": 0.0005, "compute": 0.003},
                    1: {"data_wait": 0.0005, "compute": 0.004}}, steps=20)
    assert stragglers.findings(small).empty  # 33% slower, but 1 ms: under the 5 ms floor
    assert stragglers.findings(small, rule=stragglers.Rule(floor_s=0.0005))["ranks"].tolist() \
        == ["1"]
    now_and_then = _frame({0: {"compute": 0.004}, 1: {"compute": 0.004}}, steps=20)
    late = (now_and_then["rank"] == 1) & (now_and_then["step"] < 7)
    now_and_then.loc[late, "seconds"] = 0.030
    assert stragglers.findings(now_and_then).empty  # slower in 7 of 20 steps: not most
    now_and_then.loc[(now_and_then["rank"] == 1) & (now_and_then["step"] < 15), "seconds"] = 0.03
    assert stragglers.findings(now_and_then)["ranks"].tolist() == ["1"]  # 15 of 20: 75%


def test_slow_ranks_on_one_node_are_named_as_the_node():
    slow = {"data_wait": 0.040, "compute": 0.010, "comm_wait": 0.001}
    fast = {"data_wait": 0.001, "compute": 0.010, "comm_wait": 0.040}
    frame = _frame({0: fast, 1: fast, 2: fast, 3: slow, 4: slow, 5: fast},
                   node_of=lambda r: 1 if r in (3, 4) else 0)
    (row,) = stragglers.findings(frame).itertuples()
    assert (row.ranks, row.node) == ("3,4", 1)
    assert row.finding.startswith("node 1 (ranks 3, 4)'s loader is starved")
    assert row.wait_per_step_s == pytest.approx(0.039)
    assert row.seconds_waited == pytest.approx(0.039 * 4 * 8)  # 4 other ranks x 8 steps


@pytest.mark.parametrize("field, value", [("share", -0.1), ("floor_s", "5ms"), ("most", 0.4),
                                          ("most", 1.5), ("share", True)])
def test_a_rule_outside_its_range_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"Rule.{field}={value!r}: must be a number in"):
        stragglers.Rule(**{field: value})


def test_per_rank_scores_on_nvidia_resiliencys_scale_one_is_best():
    frame = _frame({0: {"data_wait": 0.0, "compute": 0.010, "comm_wait": 0.010},
                    1: {"data_wait": 0.010, "compute": 0.010, "comm_wait": 0.0}})
    frame.loc[(frame["rank"] == 1) & (frame["step"] == 0) & (frame["stage"] == "compute"),
              "seconds"] = 0.001  # rank 1's best step is much shorter than its median
    table = stragglers.per_rank(frame)
    assert list(table.columns) == stragglers.COLUMNS
    r0, r1 = table.iloc[0], table.iloc[1]
    assert r0["relative"] == pytest.approx(1.0) and r0["individual"] == pytest.approx(1.0)
    assert r1["work_s"] == pytest.approx(0.020)  # the median step, not the mean
    assert r1["relative"] == pytest.approx(0.010 / 0.020)  # the fastest's work over its own
    assert r1["individual"] == pytest.approx(0.011 / 0.020)  # its best step over its median
    with pytest.raises(ValueError, match="lacks column"):
        stragglers.per_rank(frame.drop(columns="rank"))


def test_place_reads_the_launchers_environment(monkeypatch):
    for key, value in {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                       "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    seat = place()
    assert (seat.rank, seat.local_rank, seat.world_size, seat.node) == (5, 1, 8, 1)
    assert seat.address == "10.0.0.1:29500" and seat.distributed and not seat.is_root
    timer = StageTimer()
    with timer.stage("compute"):
        pass
    assert timer.to_frame()[["rank", "node"]].values.tolist() == [[5, 1]]
    assert (timer.local_rank, timer.world_size) == (1, 8)
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(ValueError, match="RANK='two'"):
        place()


def test_a_world_that_cannot_split_the_step_is_named_with_the_numbers():
    check_divides(4096, 128, 4, 8)  # 32 sequences = 8 ranks x 4
    with pytest.raises(ValueError, match=r"tokens_per_step=4096 \(32 sequences of 128\) is not "
                                         r"divisible by world size 3 x micro-batch 2 = 6"):
        check_divides(4096, 128, 2, 3)


def test_spilled_rows_survive_and_a_cut_line_is_dropped(tmp_path):
    timer = StageTimer(rank=1)
    timer.spill_to(tmp_path / "rank-1.partial.csv")
    for _ in timer.watch(range(3)):
        with timer.stage("compute"):
            pass
        timer.flush()
    with open(tmp_path / "rank-1.partial.csv", "a") as f:
        f.write("compute,0.0")  # a kill in the middle of a line
    rows = read_spills(tmp_path)
    assert rows.groupby("stage").size().to_dict() == {"compute": 3, "data_wait": 3}
    assert rows["step"].tolist() == [0, 0, 1, 1, 2, 2] and (rows["rank"] == 1).all()
    timer.close_spill()
    assert not list(tmp_path.iterdir())  # the complete frame is elsewhere: the spill goes


def test_shares_of_a_ddp_run_are_one_ranks_wall_clock():
    from diag import amdahl

    one = _frame({0: {"data_wait": 0.01, "compute": 0.02}})
    two = _frame({0: {"data_wait": 0.01, "compute": 0.02}, 1: {"data_wait": 0.01, "compute": 0.02}})
    pd.testing.assert_series_equal(amdahl.shares(one)["seconds"], amdahl.shares(two)["seconds"])
    compute = amdahl.shares(two).set_index("stage").loc["compute", "basis"]
    assert compute == "measured: 8 steps, mean 0.02 s/step; mean of 2 ranks"  # not 0.04: per rank
    projected = [amdahl.shares(f, total_steps=80).set_index("stage").loc["compute", "seconds"]
                 for f in (one, two)]
    assert projected == pytest.approx([0.02 * 80] * 2)


def test_the_report_has_a_bar_per_rank_and_the_per_rank_table(tmp_path):
    from diag import plots, report

    stages = _frame({0: {"data_wait": 0.001, "compute": 0.010, "comm_wait": 0.040},
                     1: {"data_wait": 0.041, "compute": 0.010, "comm_wait": 0.001}})
    fig = plots.plot_ranks(stragglers.per_rank(stages))
    assert len(fig.axes[0].patches) == 2 * 5  # one bar of five stages per rank
    folder = report.write({"qlora_stages": stages}, tmp_path / "run")
    page = (folder / "report.html").read_text()
    assert "<h2>Per rank</h2>" in page and 'alt="ranks"' in page
    assert "loader is starved" in page  # rank 1 named in the straggler table
    assert (folder / "ranks.png").is_file()
    summary = report.load_summary(folder)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]


def test_each_wait_has_its_own_bound_and_a_fill_wait_says_which(tmp_path, monkeypatch):
    import fcntl

    from diag.embedded import ensure_assets
    from diag.timing.distributed import TIMEOUTS_S, timeout_s

    assert TIMEOUTS_S == {"rendezvous": 300.0, "collective": 600.0, "fill": 1800.0,
                          "roll_call": 3.0, "say": 20.0}
    monkeypatch.setenv("DIAG_COLLECTIVE_TIMEOUT_S", "90")
    monkeypatch.setenv("DIAG_FILL_TIMEOUT_S", "0.3")
    assert (timeout_s("rendezvous"), timeout_s("collective"), timeout_s("fill")) == (300, 90, 0.3)
    (tmp_path / "assets").mkdir()
    with open(tmp_path / "assets" / ".fill.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another rank of this node is making them
        with pytest.raises(TimeoutError, match=r"waited 0.3 s for another process to make the "
                                               r"embedded assets in .*DIAG_FILL_TIMEOUT_S"):
            ensure_assets(tmp_path)
    monkeypatch.setenv("DIAG_RENDEZVOUS_TIMEOUT_S", "5min")
    with pytest.raises(ValueError, match="DIAG_RENDEZVOUS_TIMEOUT_S='5min': a number of seconds"):
        timeout_s("rendezvous")
