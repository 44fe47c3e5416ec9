"""The frame rules: which stage a sampled Python stack of a training loop's main thread is in.

RULES is one table, read top to bottom: the first rule that any frame of a stack matches names
its stage (so an eval loop's data waits are eval, a batch copy inside the loader's next is
h2d); a stack no rule matches is `other` (a `time.sleep`, logging, the loop's own Python).
Each rule names its source: the function in torch, transformers, accelerate, PyTorch Lightning
or a plain nanoGPT-style loop whose frame marks that stage (docs/attach.md shows the table).
"""

from __future__ import annotations

import functools
import linecache
import re
from typing import NamedTuple


class Rule(NamedTuple):
    stage: str
    file: str  # regex searched in the frame's path ("" = any file)
    function: str  # regex the frame's function name (its last dotted part) must match whole
    code: str  # regex searched in the executing line of a leaf frame in the user's own code
    source: str  # where the rule comes from


RULES: tuple[Rule, ...] = (
    Rule("warmup", r"^<frozen importlib|torch/_dynamo/convert_frame\.py"
         r"|torch/_inductor/compile_fx\.py", ".*", "",
         "imports (torch's lazy ones at the first step), torch.compile: paid once per start"),
    Rule("load_model", r"transformers/modeling_utils\.py", "from_pretrained", "",
         "transformers PreTrainedModel.from_pretrained"),
    Rule("eval", r"transformers/trainer\.py", r"evaluate|evaluation_loop|prediction_step", "",
         "transformers Trainer.evaluate"),
    Rule("eval", r"lightning/pytorch/loops/evaluation_loop\.py", ".*", "",
         "PyTorch Lightning evaluation loop"),
    Rule("eval", "", "estimate_loss", "", "nanoGPT train.py estimate_loss()"),
    Rule("checkpoint", r"torch/serialization\.py|safetensors/", r"save|save_file|save_model", "",
         "torch.save, safetensors"),
    Rule("checkpoint", r"transformers/trainer\.py", "_save_checkpoint|save_model", "",
         "transformers Trainer._save_checkpoint"),
    Rule("checkpoint", r"accelerate/accelerator\.py", "save_state|save_model", "",
         "accelerate Accelerator.save_state"),
    Rule("checkpoint", r"lightning/", "save_checkpoint", "", "PyTorch Lightning save_checkpoint"),
    Rule("comm_wait", r"torch/distributed/(distributed_c10d|_functional_collectives)\.py", ".*",
         "", "torch.distributed collectives and waits"),
    Rule("comm_wait", r"torch/nn/parallel/distributed\.py", "_sync_buffers|_sync_module_buffers",
         "", "DDP's buffer broadcast at forward"),
    Rule("comm_wait", r"accelerate/", "wait_for_everyone|gather|reduce|broadcast", "",
         "accelerate's collectives"),
    Rule("comm_wait", r"lightning/", "barrier|all_gather|reduce|broadcast", "",
         "PyTorch Lightning strategy collectives"),
    Rule("h2d", r"accelerate/utils/operations\.py", "send_to_device", "",
         "accelerate send_to_device"),
    Rule("h2d", r"transformers/trainer\.py", "_prepare_inputs?", "",
         "transformers Trainer._prepare_inputs"),
    Rule("h2d", r"lightning/", "batch_to_device|transfer_batch_to_device|move_data_to_device",
         "", "PyTorch Lightning batch_to_device"),
    Rule("h2d", "", "", r"\.(to|cuda)\(", "a plain loop's x.to(device) (nanoGPT get_batch)"),
    Rule("data_wait", r"torch/utils/data/dataloader\.py", "__next__", "",
         "torch DataLoader iterator __next__"),
    Rule("data_wait", r"accelerate/data_loader\.py", "__iter__|__next__", "",
         "accelerate DataLoaderShard"),
    Rule("data_wait", r"transformers/trainer\.py", "get_batch_samples", "",
         "transformers Trainer.get_batch_samples"),
    Rule("data_wait", r"lightning/pytorch/loops/fetchers\.py", ".*", "",
         "PyTorch Lightning data fetcher"),
    Rule("data_wait", "", "get_batch", "", "nanoGPT train.py get_batch()"),
    Rule("compute", r"torch/(nn|optim|autograd|amp|_dynamo|_inductor|_functorch)/"
         r"|torch/_tensor\.py|torch/functional\.py", ".*", "",
         "torch forward, backward, optimizer step"),
    Rule("compute", r"transformers/trainer\.py", "training_step|compute_loss", "",
         "transformers Trainer.training_step"),
    Rule("compute", r"accelerate/accelerator\.py", "backward", "", "accelerate backward"),
    Rule("compute", r"lightning/", "training_step|optimizer_step|backward|_run_optimization",
         "", "PyTorch Lightning training_step"),
    Rule("compute", r"peft/|bitsandbytes/|transformers/models/", ".*", "",
         "model code (transformers models, PEFT, bitsandbytes)"),
    Rule("compute", "", "", r"\.(item|backward|step)\(", "a plain loop's loss.backward(), "
         "optimizer.step(), loss.item() (a device sync)"),
)
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_INSTALLED = re.compile(r"/(site|dist)-packages/|/lib/python3\.\d+/")


def parse_frame(frame: str) -> tuple[str, str, int]:
    """py-spy's `function (file:line)` as (function, file, line); line 0 when absent."""
    got = _FRAME.match(frame)
    if got is None:
        return frame, "", 0
    return got["function"], got["file"].replace("\\", "/"), int(got["line"] or 0)


@functools.lru_cache(maxsize=4096)
def _matches(rule: Rule, frame: str, leaf: bool) -> bool:
    function, file, line = parse_frame(frame)
    if rule.code:  # the executing line of the user's own code (a library's is not read)
        if not leaf or not line or _INSTALLED.search(file):
            return False
        return re.search(rule.code, linecache.getline(file, line)) is not None
    return (re.search(rule.file, file) is not None
            and re.fullmatch(rule.function, function.rsplit(".", 1)[-1]) is not None)


def classify(frames: list[str]) -> tuple[str, str]:
    """(stage, the source of the rule that named it) of one stack, outermost frame first;
    ("other", "") when no rule matches."""
    for rule in RULES:
        if any(_matches(rule, f, i == len(frames) - 1) for i, f in enumerate(frames)):
            return rule.stage, rule.source
    return "other", ""
