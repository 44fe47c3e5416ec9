"""diag.machine.contention: the machine's state sampled while diag measures."""

import subprocess
import sys
import time

import psutil

from diag.machine import contention


def test_it_samples_load_steal_and_what_other_processes_took():
    with contention.Contention(interval_s=0.05) as machine:
        start, deadline = time.process_time(), time.monotonic() + 60
        # this process's own work (never "others") until the sampler has run twice: at load its
        # thread may wait past several intervals
        while time.process_time() - start < 0.3 or len(machine.rows) < 2:
            assert time.monotonic() < deadline
    frame = machine.frame()
    assert len(frame) >= 2 and (frame["cores"] >= 1).all()
    assert frame["others_share"].between(0, 1.05).all() and frame["steal_share"].between(0, 1).all()
    got = machine.summary()
    assert got["samples"] == len(frame) and got["load_max"] >= got["load_1min"] >= 0
    assert machine.cpu_s >= 0.3 and got["wall_over_cpu"] >= 0.9  # never less wall than CPU
    assert got["gpu_other_processes"] is None  # no GPU here: said as None, not 0


def test_a_live_childs_cpu_counts_as_diags_own():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 30: pass"])
    try:
        mine = sum(psutil.Process().cpu_times()[:2])
        deadline = time.monotonic() + 60
        while sum(psutil.Process(child.pid).cpu_times()[:2]) < 0.2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # the embedded servers and loader workers are diag's children: their work is its own
        assert contention._own_seconds() >= mine + 0.2
    finally:
        child.kill()
        child.wait()
