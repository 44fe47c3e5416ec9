"""TimingCallback inside a real transformers Trainer: injected data and compute costs come back
in the right stages, checkpoints and evaluations are kept apart, and amdahl.shares reads it."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

DATA_S = 0.01  # per sample, in __getitem__ (the main process: num_workers=0)
COMPUTE_S = 0.12  # per forward pass
MICRO, ACCUM, STEPS = 2, 2, 5


class SlowData(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []  # each sample's own (start, end)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        time.sleep(DATA_S)
        self.spans.append((start, time.perf_counter()))
        return {"x": torch.full((4,), float(i))}


class SlowModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(COMPUTE_S)
        return {"loss": self.w(x).pow(2).mean()}


class Clock(TrainerCallback):
    """A plain callback's own clock at each step's begin and end. One goes before diag's
    callback and one after, so their readings bracket diag's own: a stage diag bills between
    two hooks must lie between the inner and the outer interval, however late a loaded box
    runs any of it."""

    def __init__(self) -> None:
        self.begin: dict[int, float] = {}
        self.end: dict[int, float] = {}

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.begin[state.global_step] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.end[state.global_step - 1] = time.perf_counter()  # counted before this hook


def _train(tmp_path, warmup=1, clocks=(), data=None, model=None, callback=None, **args):
    from transformers import Trainer, TrainingArguments

    import diag

    callback = callback or diag.TimingCallback(warmup_steps=warmup)
    targs = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=MICRO,
        per_device_eval_batch_size=4, gradient_accumulation_steps=ACCUM, report_to=[],
        use_cpu=True, disable_tqdm=True, remove_unused_columns=False, logging_steps=1, **args)
    trainer = Trainer(model=model or SlowModel(), args=targs,
                      train_dataset=SlowData() if data is None else data,
                      eval_dataset=torch.utils.data.Subset(SlowData(), range(8)),
                      callbacks=[*clocks[:1], callback, *clocks[1:]])
    trainer.train()
    return callback.frame()


def test_stages_carry_the_injected_costs(tmp_path):
    from diag.amdahl import shares

    before, after, data = Clock(), Clock(), SlowData()
    frame = _train(tmp_path, clocks=(before, after), data=data, save_strategy="steps",
                   save_steps=2, eval_strategy="steps", eval_steps=2)
    steps = frame[frame["step"].notna()]
    assert sorted(steps["step"].unique()) == [1, 2, 3, 4]  # step 0 is the warm-up
    per = steps.pivot_table(index="step", columns="stage", values="seconds")
    waited = MICRO * ACCUM * DATA_S
    for k in (1, 2, 3, 4):
        # compute: between the step's hooks (the two clocks' inner and outer intervals), and
        # it holds the step's forward passes (sleeps: a load only makes them longer)
        inner, outer = before.end[k] - after.begin[k], after.end[k] - before.begin[k]
        assert ACCUM * COMPUTE_S <= inner <= per.at[k, "compute"] <= outer
        # the Trainer pulls a step's batches before on_step_begin: data_wait holds the samples
        # read since the step before (their own clocks), and not a forward pass or an eval
        gap = (before.end[k - 1], after.begin[k])
        fetched = sum(b - a for a, b in data.spans if gap[0] <= a <= gap[1])
        assert waited <= fetched <= per.at[k, "data_wait"] < fetched + COMPUTE_S
    run_level = frame[frame["step"].isna()].groupby("stage")["seconds"].agg(["count", "sum"])
    assert run_level.loc["warmup", "count"] == 1
    assert run_level.loc["checkpoint", "count"] == 3  # steps 2 and 4, and the last one
    assert run_level.loc["eval", "count"] == 3
    # eval (8 samples x DATA_S + 2 forward passes) is billed to eval, not to the next wait
    evals = 3 * (8 * DATA_S + 2 * COMPUTE_S)
    assert run_level.loc["eval", "sum"] >= evals
    table = shares(frame).set_index("stage")
    assert table.loc["compute", "share"] > table.loc["data_wait", "share"] > 0
    assert table["share"].sum() == pytest.approx(1.0)
    # train is the steady loop: its step stages and the hooks' residual; the two evaluations
    # inside it (their sleeps alone: 2/3 of evals) are not in it
    train = float(frame.loc[frame["stage"] == "train", "seconds"].sum())
    assert steps["seconds"].sum() <= train + 1e-6
    assert train - steps["seconds"].sum() < 2 / 3 * evals


class BurningModel(SlowModel):
    """Each forward pass waits COMPUTE_S (no CPU) and then burns BURN_S of this process's CPU."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(x)
        until = time.process_time() + BURN_S
        while time.process_time() < until:
            pass
        return out


BURN_S = 0.05


def test_the_warm_up_and_the_steady_loop_have_their_cpu_seconds_apart_from_their_waits(
        tmp_path):
    # what predict's check reads on a CPU: each stage's CPU seconds hold its steps' burned CPU
    # and not their waits (the sleeps, a load's time off the CPU)
    import diag

    callback = diag.TimingCallback(warmup_steps=2)
    frame = _train(tmp_path, model=BurningModel(), callback=callback, save_strategy="no")
    waits = ACCUM * (COMPUTE_S + MICRO * DATA_S)  # a step's sleeps
    wall = frame.groupby("stage")["seconds"].sum()
    for stage, steps in (("warmup", 2), ("train", STEPS - 2)):
        burned = steps * ACCUM * BURN_S
        assert burned <= callback.cpu[stage] < burned + steps * waits / 2 < wall[stage]


def test_warmup_zero_times_every_step(tmp_path):
    frame = _train(tmp_path, warmup=0, save_strategy="no")
    assert sorted(frame.loc[frame["step"].notna(), "step"].unique()) == list(range(STEPS))
    assert "warmup" not in set(frame["stage"])


def test_bad_warmup_is_a_value_error():
    import diag

    with pytest.raises(ValueError, match="warmup_steps"):
        diag.TimingCallback(warmup_steps=-1)
