"""TimingCallback inside a real transformers Trainer: injected data and compute costs come back
in the right stages, checkpoints and evaluations are kept apart, and amdahl.shares reads it."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

DATA_S = 0.01  # per sample, in __getitem__ (the main process: num_workers=0)
COMPUTE_S = 0.12  # per forward pass
MICRO, ACCUM, STEPS = 2, 2, 5


class SlowData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(DATA_S)
        return {"x": torch.full((4,), float(i))}


class SlowModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(COMPUTE_S)
        return {"loss": self.w(x).pow(2).mean()}


def _train(tmp_path, warmup=1, **args):
    from transformers import Trainer, TrainingArguments

    import diag

    callback = diag.TimingCallback(warmup_steps=warmup)
    targs = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=MICRO,
        per_device_eval_batch_size=4, gradient_accumulation_steps=ACCUM, report_to=[],
        use_cpu=True, disable_tqdm=True, remove_unused_columns=False, logging_steps=1, **args)
    trainer = Trainer(model=SlowModel(), args=targs, train_dataset=SlowData(),
                      eval_dataset=torch.utils.data.Subset(SlowData(), range(8)),
                      callbacks=[callback])
    trainer.train()
    return callback.frame()


def test_stages_carry_the_injected_costs(tmp_path):
    from diag.amdahl import shares

    frame = _train(tmp_path, save_strategy="steps", save_steps=2, eval_strategy="steps",
                   eval_steps=2)
    steps = frame[frame["step"].notna()]
    assert sorted(steps["step"].unique()) == [1, 2, 3, 4]  # step 0 is the warm-up
    per = steps.pivot_table(index="step", columns="stage", values="seconds")
    waited = MICRO * ACCUM * DATA_S
    # the Trainer pulls a step's batches before on_step_begin: data_wait, not compute
    assert (per["data_wait"] >= waited).all()
    assert (per["data_wait"] < COMPUTE_S).all(), "data_wait holds no forward pass"
    assert (per["compute"] >= ACCUM * COMPUTE_S).all()
    assert (per["compute"] < ACCUM * COMPUTE_S + waited + 0.5 * COMPUTE_S).all()
    run_level = frame[frame["step"].isna()].groupby("stage")["seconds"].agg(["count", "sum"])
    assert run_level.loc["warmup", "count"] == 1
    assert run_level.loc["checkpoint", "count"] == 3  # steps 2 and 4, and the last one
    assert run_level.loc["eval", "count"] == 3
    # eval (8 samples x DATA_S + 2 forward passes) is billed to eval, not to the next wait
    assert run_level.loc["eval", "sum"] >= 3 * (8 * DATA_S + 2 * COMPUTE_S)
    table = shares(frame).set_index("stage")
    assert table.loc["compute", "share"] > table.loc["data_wait", "share"] > 0
    assert table["share"].sum() == pytest.approx(1.0)
    # train is the steady loop: its step stages and a small residual, no checkpoint or eval
    train = float(frame.loc[frame["stage"] == "train", "seconds"].sum())
    assert steps["seconds"].sum() <= train + 1e-6
    assert train - steps["seconds"].sum() < 0.5


def test_warmup_zero_times_every_step(tmp_path):
    frame = _train(tmp_path, warmup=0, save_strategy="no")
    assert sorted(frame.loc[frame["step"].notna(), "step"].unique()) == list(range(STEPS))
    assert "warmup" not in set(frame["stage"])


def test_bad_warmup_is_a_value_error():
    import diag

    with pytest.raises(ValueError, match="warmup_steps"):
        diag.TimingCallback(warmup_steps=-1)
