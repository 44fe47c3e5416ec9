"""The job's 4-bit base: its `Sources`, its model folder, its nf4 load with LoRA on every
projection, and the bases a comparison keeps for its rounds (`Bases`)."""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diag.files import scratch_folder
from diag.machine.device import sync
from diag.model_load import ALLOW_PATTERNS, cache_dir_for, not_in_user_cache, snapshot_folder
from diag.noise import Rounds, unsettled

if TYPE_CHECKING:
    from diag.config import JobConfig
    from diag.qlora.plans import Plan
    from diag.timing import StageTimer

@dataclass(frozen=True)
class Sources:
    """Where the dataset and the model come from (the embedded servers or the user's)."""

    url: str  # s3://bucket/key (JSONL or Parquet) or s3://bucket/prefix/ of shards
    client: Any  # boto3 S3 client for url
    model: str  # hub repo id, or a local folder (nothing to download)
    endpoint: str | None  # hub endpoint; None = HF_ENDPOINT or the real hub
    revision: str = "main"  # of a hub model
    cache_dir: Path | None = None  # the optimized plan's persistent HF cache; None: the default
    read_only: bool = False  # cache_dir is your own HF cache: read, never written


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_folder(plan: Plan, src: Sources, work: Path) -> Path:
    """The snapshot folder: downloaded into an empty cache, or read from the persistent one."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if Path(src.model).is_dir():  # a local model: read where it is, in both plans
        return Path(src.model)
    kwargs = {"allow_patterns": ALLOW_PATTERNS, "endpoint": src.endpoint, "revision": src.revision}
    if plan.model_cache == "empty":
        return Path(snapshot_download(src.model, cache_dir=work / "hf-cache", **kwargs))
    cache = src.cache_dir or cache_dir_for()  # the one diag.model_load's cached scenarios read
    if src.read_only:  # your cache's snapshot as it is (part of a repo is fine), never written
        folder = snapshot_folder(cache, src.model, src.revision)
        if folder is None:
            raise not_in_user_cache(src.model, src.revision, cache)
        return folder
    try:
        return Path(snapshot_download(src.model, cache_dir=cache, local_files_only=True, **kwargs))
    except LocalEntryNotFoundError:  # diag's own cache: the first start fills it
        return Path(snapshot_download(src.model, cache_dir=cache, **kwargs))


# a folder is re-timed until settled: at most FOLDER_REPEATS starts, while each is cheap, in budget
FOLDER_REPEATS, FOLDER_CHEAP_S, FOLDER_BUDGET_S = 16, 2.0, 3.0


def timed_folder(plan: Plan, src: Sources, work: Path) -> tuple[Path, dict[str, float]]:
    """The plan's model folder and a start's median seconds for it per clock, until settled."""
    folders: list[Path] = []

    def start() -> list[float]:
        here = work / f"again-{len(folders)}" if folders else work
        wall, cpu = time.perf_counter(), time.process_time()
        folders.append(model_folder(plan, src, here))
        took = [time.perf_counter() - wall, time.process_time() - cpu]
        if len(folders) > 1:
            shutil.rmtree(here, ignore_errors=True)
        return took

    wall, cpu = Rounds(start, lambda got: got[0][-1] < FOLDER_CHEAP_S and unsettled({0: got[0]}),
                       budget_s=FOLDER_BUDGET_S, max_rounds=FOLDER_REPEATS, min_rounds=1).run()
    return folders[0], {"wall": statistics.median(wall), "CPU": statistics.median(cpu)}


def load_model(cfg: JobConfig, plan: Plan, folder: Path, device: Any, base: Any = None) -> Any:
    """The nf4 base (or `base`, loaded before) with a fresh seeded LoRA on every projection."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = load_base(plan, folder, device) if base is None else base
    torch.manual_seed(cfg.seed)
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(base, lora)


def load_base(plan: Plan, folder: Path, device: Any) -> Any:
    """The base in nf4, prepared for k-bit training: what a trained adapter is put on."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    # bf16 compute on CPU too: bitsandbytes' CPU 4-bit kernels take it, and it matches the GPU
    compute = torch.bfloat16 if device.type == "cpu" or torch.cuda.is_bf16_supported() \
        else torch.float16
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant,
                                                 device_map={"": str(device)})
    model.config.use_cache = False  # with a cache transformers skips the packed-sequence mask
    # bitsandbytes repacks a Linear4bit in place at its first no-grad forward on an AVX512-BF16
    # CPU (absmax rounded): a resumed run would train on another base than the one it left
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    # checkpointing by transformers 5's name (peft's own call uses the deprecated one)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if plan.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})  # what torch recommends
    return model


REUSED = "measured once per plan, as its base first loaded: this round reused that base, a " \
    "fresh adapter"


class Bases:
    """A comparison's bases per plan and device: the first load timed, then a fresh adapter."""

    def __init__(self) -> None:
        self.work = scratch_folder("diag-qlora-bases")  # a killed rank's is swept next time
        self._held: dict[tuple[Any, ...], tuple[Path, Any, dict[str, dict[str, float]]]] = {}
        self._lent: list[Any] = []  # the peft models on kept bases, until release()
        self.timed: dict[str, dict[str, dict[str, float]]] = {}

    def __enter__(self) -> Bases:
        return self

    def __exit__(self, *_: Any) -> None:
        self.release()
        self._held.clear()
        shutil.rmtree(self.work, ignore_errors=True)

    def load(self, cfg: JobConfig, plan: Plan, src: Sources, device: Any, timer: StageTimer
             ) -> tuple[Path, Any, bool]:
        """(the model folder, the base with a fresh adapter, whether the base was reused)."""
        key = (plan.name, plan.model_cache, plan.gradient_checkpointing, str(device))
        reused = key in self._held
        if not reused:
            folder, folder_s = timed_folder(plan, src, self.work)
            start, used = time.perf_counter(), time.process_time()
            model = load_model(cfg, plan, folder, device)
            sync(device)  # note: sync point, so the load's copies to the device are in it
            load = {"wall": folder_s["wall"] + time.perf_counter() - start,
                    "CPU": folder_s["CPU"] + time.process_time() - used}
            self._held[key] = (folder, model.get_base_model(),
                               {"load_model": load, "download": folder_s})
        folder, base, self.timed[plan.name] = self._held[key]
        self._lent.append(load_model(cfg, plan, folder, device, base) if reused else model)
        timer.record("load_model", self.timed[plan.name]["load_model"]["wall"])
        return folder, self._lent[-1], reused

    def release(self) -> None:
        while self._lent:
            self._lent.pop().unload().eval()
