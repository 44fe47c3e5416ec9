"""`diag train --lr-schedule`: the learning rate each optimizer step trained at follows the named
schedule after its warm-up, step by step (a short run on the embedded data per schedule)."""

from __future__ import annotations

import math

import pytest

from diag.config import TrainConfig

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

pytestmark = [pytest.mark.xdist_group("test_lr_schedule"), pytest.mark.slow]  # ~3 s a run
STEPS, WARMUP, LR = 4, 1, 2e-4


def _curve(schedule: str, k: int) -> float:
    """The rate of the k-th step (0-based): linear warm-up over WARMUP steps from 0, then the
    schedule over the STEPS - WARMUP left."""
    if k < WARMUP:
        return LR * k / WARMUP
    done = (k - WARMUP) / (STEPS - WARMUP)
    return LR * {"cosine": 0.5 * (1 + math.cos(math.pi * done)), "linear": 1 - done,
                 "constant": 1.0}[schedule]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_each_step_trains_at_the_schedules_rate(schedule, tmp_path):
    from diag.qlora import run_train

    cfg = TrainConfig.quick(out_dir=str(tmp_path / "out"), max_steps=STEPS, lr=LR,
                            lr_schedule=schedule, lr_warmup=WARMUP / STEPS, device="cpu",
                            eval_every=STEPS, checkpoint_every=STEPS)
    losses = run_train(cfg, decisions=()).losses
    train = losses[losses["split"] == "train"].set_index("step")["learning_rate"]
    assert list(train.index) == list(range(1, STEPS + 1))
    want = [_curve(schedule, k) for k in range(STEPS)]
    assert train.tolist() == pytest.approx(want, rel=1e-6, abs=1e-12), (schedule, train.tolist())
