"""A resume starts from the newest complete checkpoint: by step number (checkpoint-10 after
checkpoint-9), never a half-written one or one whose state names another step; checkpoints
written through save_whole as the Trainer's saves are (nothing trains)."""

from __future__ import annotations

import json
import os

import pytest

from diag.config import TrainConfig
from diag.qlora import checkpoints


def _save(out, step: int, keep: int = 3, state_step: int | None = None) -> None:
    def write(tmp):
        (tmp / "adapter_model.safetensors").write_bytes(b"w" * step)
        (tmp / "trainer_state.json").write_text(json.dumps(
            {"global_step": step if state_step is None else state_step}))

    checkpoints.save_whole(out / f"checkpoint-{step}", write, keep=keep)


def test_the_newest_kept_checkpoint_is_the_resume_point(tmp_path):
    for step in (2, 9, 10):
        _save(tmp_path, step)
    assert checkpoints.last_checkpoint(tmp_path).name == "checkpoint-10"  # not "-9" (by name)
    assert [s for s, _ in checkpoints.checkpoints(tmp_path)] == [2, 9, 10]
    _save(tmp_path, 11, keep=2)  # the oldest go: the newest stay the resume point
    assert [s for s, _ in checkpoints.checkpoints(tmp_path)] == [10, 11]
    assert checkpoints.last_checkpoint(tmp_path).name == "checkpoint-11"
    with pytest.raises(ValueError, match=r"\(up to step 11\): pass --resume"):
        checkpoints.claim(tmp_path, TrainConfig(out_dir=str(tmp_path)).identity(), resume=False)


def test_a_half_written_or_foreign_checkpoint_is_never_the_resume_point(tmp_path):
    assert checkpoints.last_checkpoint(tmp_path) is None
    _save(tmp_path, 4)
    (tmp_path / "checkpoint-12").mkdir()  # killed before its state was written
    (tmp_path / "checkpoint-12" / "adapter_model.safetensors").write_bytes(b"half")
    _save(tmp_path, 8, state_step=3)  # its state names another step: not this checkpoint
    (tmp_path / "checkpoint-x").mkdir()
    assert checkpoints.last_checkpoint(tmp_path).name == "checkpoint-4"
    assert [s for s, _ in checkpoints.checkpoints(tmp_path)] == [4]


def test_a_new_run_in_a_folder_without_checkpoints_starts_its_own_run_file(tmp_path):
    old = TrainConfig(out_dir=str(tmp_path), lr=1e-3).identity()
    assert checkpoints.claim(tmp_path, old, resume=False) is None
    checkpoints.record(tmp_path, {"eval_loss_0": 7.5})  # what that run noted, killed before a save
    new = TrainConfig(out_dir=str(tmp_path)).identity()
    assert checkpoints.claim(tmp_path, new, resume=False) is None  # no checkpoint: no conflict
    assert json.loads((tmp_path / checkpoints.RUN_FILE).read_text()) == new  # not merged


def test_every_refusal_names_the_folder(tmp_path):
    _save(tmp_path, 3)
    run = TrainConfig(out_dir=str(tmp_path)).identity()
    with pytest.raises(ValueError, match=rf"^--out-dir='{tmp_path}' holds the checkpoints"):
        checkpoints.claim(tmp_path, run, resume=False)
    checkpoints.record(tmp_path, run, fresh=True)
    with pytest.raises(ValueError) as err:
        checkpoints.claim(tmp_path, {**run, "lr": 1.0}, resume=True)
    assert str(err.value) == (f"--resume: the run in '{tmp_path}' was started with "
                              f"lr={run['lr']!r}, this one asks lr=1.0; resume with the same "
                              "settings, or name a new --out-dir")
    with pytest.raises(ValueError, match=rf"^--out-dir='{tmp_path}/diag-run.json': is a file"):
        checkpoints.claim(tmp_path / checkpoints.RUN_FILE, run, resume=False)


def test_a_first_save_out_of_room_says_there_is_no_checkpoint_and_what_to_do(tmp_path):
    import errno

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RuntimeError) as err:
        checkpoints.save_whole(tmp_path / "checkpoint-1", full, keep=2)
    assert str(err.value) == (f"checkpoint checkpoint-1: writing under {tmp_path} failed (No "
                              "space left on device); nothing of it was kept, no earlier "
                              "checkpoint: free space, then continue with --resume")


def test_a_save_sweeps_what_a_killed_save_left(tmp_path):
    import subprocess
    import sys

    from diag.files import temp_path

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    left = temp_path(tmp_path / "checkpoint-2")  # as its writer named it, then it was killed
    left = left.with_name(left.name.replace(f"-{os.getpid()}-", f"-{gone.stdout.strip()}-"))
    (left / "sub").mkdir(parents=True)
    _save(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
