"""diag.files' atomic writes: a target is the old one or the whole new one, never part of it,
whether the writer raises or is killed; what a killed writer left is swept, a live one's kept."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from diag.files import atomic_file, atomic_folder, scratch_folder, sweep_orphans, temp_path


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_a_file_that_fails_mid_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "sub" / "manifest.json"
    with pytest.raises(RuntimeError, match="cut"):
        with atomic_file(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("cut")
    assert names(path.parent) == []  # neither the target nor the temporary
    with atomic_file(path) as tmp:
        tmp.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as tmp:
            tmp.write_text("new, half")
            raise RuntimeError("cut")
    assert path.read_text() == "old" and names(path.parent) == ["manifest.json"]


def test_a_folder_is_swapped_in_whole_or_not_at_all(tmp_path):
    folder = tmp_path / "cache"
    with atomic_folder(folder) as tmp:
        (tmp / "a.bin").write_bytes(b"1")
    with pytest.raises(KeyboardInterrupt):
        with atomic_folder(folder) as tmp:
            (tmp / "a.bin").write_bytes(b"2")
            raise KeyboardInterrupt
    assert names(folder) == ["a.bin"] and (folder / "a.bin").read_bytes() == b"1"
    with atomic_folder(folder) as tmp:
        (tmp / "b.bin").write_bytes(b"3")
    assert names(folder) == ["b.bin"]  # replaced, not merged
    with atomic_folder(folder, replace=False) as tmp:  # another writer's is already there
        (tmp / "c.bin").write_bytes(b"4")
    assert names(folder) == ["b.bin"] and names(tmp_path) == ["cache"]


def test_a_killed_writer_leaves_only_temporaries_which_are_swept(tmp_path):
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        from diag.files import atomic_file, atomic_folder
        root = pathlib.Path({str(tmp_path)!r})
        with atomic_file(root / "data.jsonl") as f, atomic_folder(root / "model") as d:
            f.write_text("{{}}" * 1000)
            (d / "weights.safetensors").write_bytes(b"0" * 1000)
            print("ready", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    left = names(tmp_path)
    assert len(left) == 2 and all(n.startswith(".") and f".tmp-{proc.pid}-" in n for n in left)
    live = temp_path(tmp_path / "data.jsonl")  # this process's: still writing
    live.write_text("")
    (tmp_path / ".notes.tmp-1-x").write_text("")  # not diag's name: never judged
    sweep_orphans(tmp_path)
    assert names(tmp_path) == sorted([live.name, ".notes.tmp-1-x"])
    sweep_orphans(tmp_path / "absent")  # a folder not made yet: nothing to sweep


def test_a_runs_scratch_folder_left_by_a_killed_process_goes_at_the_next_start(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    left = tmp_path / f".diag-qlora-naive.tmp-{dead}-0123abcd"  # a killed rank's data + model
    (left / "data").mkdir(parents=True)
    mine = scratch_folder("diag-qlora-naive")
    assert mine.is_dir() and not any(mine.iterdir()) and not left.exists()
    assert scratch_folder("diag-qlora-naive") != mine and mine.is_dir()  # a live run's kept
