"""A resume starts from the newest complete checkpoint: by step number (checkpoint-10 after
checkpoint-9), never a half-written one or one whose state names another step; checkpoints
written through save_whole as the Trainer's saves are (nothing trains)."""

from __future__ import annotations

import json

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
