"""The frame rules on stacks shaped as py-spy samples them from each framework's loop: the stage
a stack names, and which rule wins where two match (constructed stacks, no process)."""

from __future__ import annotations

import pytest

from diag.observe import RULES, classify

SITE = "/venv/lib/python3.11/site-packages"
LOOP = [f"<module> ({__file__}:1)"]  # the user's script, outermost
TORCH_NEXT = f"_BaseDataLoaderIter.__next__ ({SITE}/torch/utils/data/dataloader.py:733)"
FORWARD = f"Module._call_impl ({SITE}/torch/nn/modules/module.py:1789)"
BACKWARD = f"Tensor.backward ({SITE}/torch/_tensor.py:623)"
TRAINER = f"Trainer._inner_training_loop ({SITE}/transformers/trainer.py:2520)"


def frame(function: str, file: str, line: int = 10) -> str:
    return f"{function} ({SITE}/{file}:{line})"


@pytest.mark.parametrize("stack, stage", [
    # torch's DataLoader, under any loop
    ([*LOOP, TORCH_NEXT, frame("Queue.get", "../multiprocessing/queues.py")], "data_wait"),
    # a plain loop's forward, backward and optimizer step
    ([*LOOP, FORWARD, frame("Linear.forward", "torch/nn/modules/linear.py")], "compute"),
    ([*LOOP, BACKWARD], "compute"),
    ([*LOOP, frame("AdamW.step", "torch/optim/adamw.py")], "compute"),
    # transformers Trainer: its batch fetch, its copy to the device, its training step
    ([*LOOP, TRAINER, frame("Trainer.get_batch_samples", "transformers/trainer.py"),
      frame("DataLoaderShard.__iter__", "accelerate/data_loader.py"), TORCH_NEXT],
     "data_wait"),
    ([*LOOP, TRAINER, frame("DataLoaderShard.__iter__", "accelerate/data_loader.py"),
      frame("send_to_device", "accelerate/utils/operations.py")], "h2d"),
    ([*LOOP, TRAINER, frame("Trainer.training_step", "transformers/trainer.py")], "compute"),
    # an evaluation inside training is eval, its forwards and data waits included
    ([*LOOP, TRAINER, frame("Trainer.evaluate", "transformers/trainer.py"),
      frame("Trainer.evaluation_loop", "transformers/trainer.py"), TORCH_NEXT], "eval"),
    ([*LOOP, TRAINER, frame("Trainer._save_checkpoint", "transformers/trainer.py"),
      frame("save_file", "safetensors/torch.py")], "checkpoint"),
    # PyTorch Lightning
    ([*LOOP, frame("_DataFetcher.__next__", "lightning/pytorch/loops/fetchers.py")],
     "data_wait"),
    ([*LOOP, frame("_EvaluationLoop.run", "lightning/pytorch/loops/evaluation_loop.py"),
      FORWARD], "eval"),
    ([*LOOP, frame("LightningModule.optimizer_step", "lightning/pytorch/core/module.py")],
     "compute"),
    # DDP: a collective inside backward is waiting on the other ranks
    ([*LOOP, BACKWARD, frame("all_reduce", "torch/distributed/distributed_c10d.py")],
     "comm_wait"),
    # start-up: an import (torch's lazy ones at the first step) is warm-up, not compute
    ([*LOOP, frame("AdamW.step", "torch/optim/adamw.py"),
      "_find_and_load (<frozen importlib._bootstrap>:1176)"], "warmup"),
    # time.sleep (or logging) outside every stage: other, never compute
    ([*LOOP], "other"),
])
def test_a_stack_gets_its_stage(stack, stage):
    assert classify(stack)[0] == stage


def test_plain_loop_lines_name_their_stage(tmp_path):
    # nanoGPT-shaped lines, read from the file py-spy names: a batch copy, a sync on the loss
    script = tmp_path / "train.py"
    script.write_text("x, y = x.to(device), y.to(device)\nlossf = loss.item() * 4\n"
                      "time.sleep(0.1)\n")
    assert classify([f"<module> ({script}:1)"])[0] == "h2d"
    assert classify([f"<module> ({script}:2)"])[0] == "compute"
    assert classify([f"<module> ({script}:3)"])[0] == "other"
    # nanoGPT's own functions by name
    assert classify([f"<module> ({script}:3)", f"get_batch ({script}:1)"])[0] == "h2d"
    assert classify([f"<module> ({script}:3)", f"get_batch ({script}:3)"])[0] == "data_wait"
    assert classify([f"<module> ({script}:3)", f"estimate_loss ({script}:3)"])[0] == "eval"


def test_a_library_line_is_never_read_as_the_users():
    # torch's own `.to(` lines inside the DataLoader stay data_wait, not h2d
    pin = frame("pin_memory", "torch/utils/data/_utils/pin_memory.py")
    assert classify([*LOOP, TORCH_NEXT, pin])[0] == "data_wait"


def test_every_rule_names_a_stage_and_its_source():
    from diag.timing import STAGES

    assert all(r.stage in STAGES and r.source and (r.file or r.function or r.code)
               for r in RULES)
    sources = " ".join(r.source for r in RULES)
    for framework in ("torch", "transformers", "accelerate", "Lightning", "nanoGPT"):
        assert framework in sources
