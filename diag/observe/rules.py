"""Which stage a sampled main-thread Python stack is in: the first of RULES (top to bottom) that
any frame matches (an eval loop's data waits are eval); none: `other` (docs/attach.md).
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
    source: str  # where the rule comes from
    code: str = ""  # regex searched in the executing line of a leaf frame in the user's own code


_PL, _TR, _ACC = "PyTorch Lightning", "transformers Trainer", "accelerate"
RULES: tuple[Rule, ...] = (
    Rule("warmup", r"^<frozen importlib|torch/_dynamo/convert_frame\.py"
         r"|torch/_inductor/compile_fx\.py", ".*", "imports (torch's lazy ones), compile"),
    Rule("load_model", r"transformers/modeling_utils\.py", "from_pretrained", "transformers"),
    Rule("eval", r"transformers/trainer\.py", r"evaluate|evaluation_loop|prediction_step", _TR),
    Rule("eval", r"lightning/pytorch/loops/evaluation_loop\.py", ".*", _PL),
    Rule("eval", "", "estimate_loss", "nanoGPT train.py estimate_loss()"),
    Rule("checkpoint", r"torch/serialization\.py|safetensors/", r"save|save_file|save_model",
         "torch.save, safetensors"),
    Rule("checkpoint", r"transformers/trainer\.py", "_save_checkpoint|save_model", _TR),
    Rule("checkpoint", r"accelerate/accelerator\.py", "save_state|save_model", _ACC),
    Rule("checkpoint", r"lightning/", "save_checkpoint", _PL),
    Rule("comm_wait", r"torch/distributed/(distributed_c10d|_functional_collectives)\.py", ".*",
         "torch.distributed"),
    Rule("comm_wait", r"torch/nn/parallel/distributed\.py", "_sync_buffers|_sync_module_buffers",
         "DDP's buffer broadcast at forward"),
    Rule("comm_wait", r"accelerate/", "wait_for_everyone|gather|reduce|broadcast", _ACC),
    Rule("comm_wait", r"lightning/", "barrier|all_gather|reduce|broadcast", _PL),
    Rule("h2d", r"accelerate/utils/operations\.py", "send_to_device", _ACC),
    Rule("h2d", r"transformers/trainer\.py", "_prepare_inputs?", _TR),
    Rule("h2d", r"lightning/", "batch_to_device|transfer_batch_to_device|move_data_to_device", _PL),
    Rule("h2d", "", "", "a plain loop's x.to(device) (nanoGPT get_batch)", r"\.(to|cuda)\("),
    Rule("data_wait", r"torch/utils/data/dataloader\.py", "__next__", "torch DataLoader"),
    Rule("data_wait", r"accelerate/data_loader\.py", "__iter__|__next__", _ACC),
    Rule("data_wait", r"transformers/trainer\.py", "get_batch_samples", _TR),
    Rule("data_wait", r"lightning/pytorch/loops/fetchers\.py", ".*", _PL),
    Rule("data_wait", "", "get_batch", "nanoGPT train.py get_batch()"),
    Rule("compute", r"torch/(nn|optim|autograd|amp|_dynamo|_inductor|_functorch)/"
         r"|torch/_tensor\.py|torch/functional\.py", ".*", "torch forward, backward, step"),
    Rule("compute", r"transformers/trainer\.py", "training_step|compute_loss", _TR),
    Rule("compute", r"accelerate/accelerator\.py", "backward", _ACC),
    Rule("compute", r"lightning/", "training_step|optimizer_step|backward|_run_optimization", _PL),
    Rule("compute", r"peft/|bitsandbytes/|transformers/models/", ".*", "model code"),
    Rule("compute", "", "", "a plain loop's loss.backward(), optimizer.step(), loss.item() (a "
         "device sync)", r"\.(item|backward|step)\("),
)
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_INSTALLED = re.compile(r"/(site|dist)-packages/|/lib/python3\.\d+/")


def parse_frame(frame: str) -> tuple[str, str, int]:
    """py-spy's `function (file:line)` as (function, file, line); line 0 when absent."""
    got = _FRAME.match(frame)
    return (frame, "", 0) if got is None else (
        got["function"], got["file"].replace("\\", "/"), int(got["line"] or 0))


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
    """(stage, its rule's source) of one stack, outermost frame first; ("other", "") for none."""
    for rule in RULES:
        if any(_matches(rule, f, i == len(frames) - 1) for i, f in enumerate(frames)):
            return rule.stage, rule.source
    return "other", ""
