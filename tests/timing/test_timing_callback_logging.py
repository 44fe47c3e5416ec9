"""TimingCallback under the logging, evaluation and saving cadences users run: the wait of a step
is measured from the previous step's end whether or not a log, an eval or a save came between."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from tests.timing.test_timing_callback import ACCUM, COMPUTE_S, DATA_S, MICRO, SlowData, SlowModel  # noqa: E402

STEPS = 5


@pytest.mark.parametrize("logging_steps", [1, 50])
def test_data_wait_per_step_holds_at_every_logging_cadence(tmp_path, logging_steps):
    from transformers import Trainer, TrainingArguments

    import diag

    callback = diag.TimingCallback(warmup_steps=1)
    # users' default logging_steps is 500: with logging_steps > max_steps no on_log comes between
    # steps, so only on_step_end can move the mark the next wait is measured from
    targs = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=MICRO,
        per_device_eval_batch_size=4, gradient_accumulation_steps=ACCUM, report_to=[],
        use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        logging_steps=logging_steps, save_strategy="steps", save_steps=2,
        eval_strategy="steps", eval_steps=2)
    data = SlowData()
    trainer = Trainer(model=SlowModel(), args=targs, train_dataset=data,
                      eval_dataset=torch.utils.data.Subset(SlowData(), range(8)),
                      callbacks=[callback])
    trainer.train()
    frame = callback.frame()
    waits = frame.loc[frame["stage"] == "data_wait"].set_index("step")["seconds"]
    assert sorted(waits.index) == [1, 2, 3, 4]
    per = MICRO * ACCUM
    assert (waits >= per * DATA_S).all()
    # a mark left behind would bill the previous step's forward passes (ACCUM x COMPUTE_S) or an
    # evaluation to this step's wait: more than a forward pass beyond the step's samples' own
    # clocks (the Trainer pulls a step's batches before on_step_begin), which a busy machine
    # lengthens as much as the wait
    fetched = {k: sum(end - start for start, end in data.spans[k * per:(k + 1) * per])
               for k in waits.index}
    assert all(waits[k] < fetched[k] + COMPUTE_S for k in waits.index), (waits.to_dict(), fetched)
    run_level = frame[frame["step"].isna()].groupby("stage")["seconds"].count()
    assert run_level["eval"] == 3 and run_level["checkpoint"] == 3  # steps 2, 4 and the last
