"""Synthetic stand-ins for a real fine-tuning setup, made once under DIAG_HOME and reused whole.

`synthetic_records`/`synthetic_dataset`: seeded instruction triples with correct answers, as JSONL;
`tiny_model`: a random-weight Llama and a BPE tokenizer trained on that data; `ensure_assets()`:
both, published into the hub root `HubServer` serves; `embedded_dataset`: any size, for storage."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.config import diag_home
from diag.embedded.hub import publish_model
from diag.files import atomic_file, atomic_folder, sweep_orphans
from diag.timing.distributed import timeout_s

_ADJECTIVES = """quick lazy bright quiet heavy small large ancient modern red blue green yellow
    silver golden happy sleepy brave clever gentle noisy calm shiny rough smooth""".split()
_NOUNS = ("fox dog cat river mountain robot teacher garden window engine forest city bridge ocean "
          "planet library kettle lantern violin pilot farmer tower meadow compass").split()
_VERBS = ("jumps over|walks past|watches|follows|paints|builds|finds|carries|greets|repairs|visits|"
          "chases|draws|measures|admires").split("|")
_FRUITS = "apple banana cherry grape lemon mango orange peach pear plum".split()
# (from unit, to unit, factor, decimals): linear conversions with exact answers to `decimals`
_UNITS = (("kilometers", "meters", 1000.0, 0), ("meters", "centimeters", 100.0, 0),
          ("kilograms", "grams", 1000.0, 0), ("hours", "minutes", 60.0, 0),
          ("minutes", "seconds", 60.0, 0), ("inches", "centimeters", 2.54, 2),
          ("miles", "kilometers", 1.609344, 3), ("liters", "milliliters", 1000.0, 0))
_MB = 1_000_000  # target_mb counts decimal megabytes, like disk and network rates do
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4},  # ~1.6 MB, about a second
    "small": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16},  # ~420 MB fp32, ~5 s
}
DATASET_MB = 4  # the embedded dataset: big enough to time, small enough to make in a second


def _sentence(rng: random.Random) -> str:
    return (f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} "
            f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}")


def _record(rng: random.Random) -> tuple[str, str, str]:
    """One (instruction, input, output) of a kind drawn first."""
    kind = rng.choice(("arithmetic", "sort_numbers", "sort_words", "reverse", "convert", "celsius",
                       "count", "upper"))
    if kind == "arithmetic":
        a, b, op = rng.randint(0, 999), rng.randint(1, 999), rng.choice("+-*")
        return f"What is {a} {op} {b}?", "", str({"+": a + b, "-": a - b, "*": a * b}[op])
    if kind == "sort_numbers":
        nums = [rng.randint(-50, 500) for _ in range(rng.randint(3, 9))]
        desc = rng.random() < 0.5
        return (f"Sort these numbers in {'descending' if desc else 'ascending'} order.",
                ", ".join(map(str, nums)), ", ".join(map(str, sorted(nums, reverse=desc))))
    if kind == "sort_words":
        words = rng.sample(_FRUITS + _NOUNS, rng.randint(3, 7))
        return "Sort these words alphabetically.", " ".join(words), " ".join(sorted(words))
    if kind == "convert":
        src, dst, factor, decimals = rng.choice(_UNITS)
        value = rng.randint(1, 500)
        out = round(value * factor, decimals)
        out_text = str(int(out)) if decimals == 0 else f"{out:.{decimals}f}"
        return f"Convert {value} {src} to {dst}.", "", f"{value} {src} is {out_text} {dst}."
    if kind == "celsius":
        c = rng.randint(-40, 120)
        return (f"Convert {c} degrees Celsius to Fahrenheit.", "",
                f"{c} C is {c * 9 / 5 + 32:.1f} F.")
    if kind == "count":
        s = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        return "How many words are in this text?", s, str(len(s.split()))
    s = _sentence(rng)
    if kind == "reverse":
        return "Reverse the order of the words.", s, " ".join(reversed(s.split()))
    return "Rewrite the sentence in capital letters.", s, s.upper()


def synthetic_records(n: int | None, seed: int = 0) -> Iterator[dict[str, str]]:
    """Yield `n` deterministic {"instruction", "input", "output"} records (forever if n is None)."""
    if n is not None and n < 0:
        raise ValueError(f"n={n!r}: must be >= 0 (or None for an endless stream)")
    rng = random.Random(seed)
    for _ in range(n) if n is not None else itertools.count():
        instruction, inp, out = _record(rng)
        yield {"instruction": instruction, "input": inp, "output": out}


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r}: must be a number > 0")


def synthetic_dataset(path: str | os.PathLike[str], *, records: int | None = None,
                      target_mb: float | None = None, seed: int = 0) -> Path:
    """Write JSONL atomically: exactly `records` lines, or the first reaching `target_mb`."""
    if (records is None) == (target_mb is None):
        raise ValueError("give exactly one of records=<lines> or target_mb=<megabytes>")
    _check_positive(*(("target_mb", target_mb) if records is None else ("records", records)))
    if records is not None and not isinstance(records, int):
        raise ValueError(f"records={records!r}: must be a whole number of lines")
    path = Path(path)
    limit = None if target_mb is None else int(target_mb * _MB)
    written = 0
    # a large buffer: this is the hot loop when making a multi-GB file
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8", buffering=4 << 20) as f:
        encode = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps's output, once
        for rec in synthetic_records(records, seed):
            line = encode(rec) + "\n"
            f.write(line)
            written += len(line) if line.isascii() else len(line.encode("utf-8"))
            if limit is not None and written >= limit:
                break
    return path


def tiny_model(out_dir: str | os.PathLike[str], *, hidden_size: int = 64, num_layers: int = 2,
               num_heads: int = 4, intermediate_size: int | None = None, vocab_size: int = 2048,
               seed: int = 0, dataset: str | os.PathLike[str] | None = None) -> Path:
    """Save a random-weight Llama and a BPE tokenizer trained on `dataset` (or synthetic)."""
    if intermediate_size is None:
        intermediate_size = -(-(8 * hidden_size // 3) // 64) * 64  # Llama's ~8/3, up to 64s
    for name, value in (("hidden_size", hidden_size), ("num_layers", num_layers),
                        ("num_heads", num_heads), ("vocab_size", vocab_size),
                        ("intermediate_size", intermediate_size)):
        _check_positive(name, value)
        if name in ("hidden_size", "intermediate_size") and value % 64:
            raise ValueError(f"{name}={value}: must be a multiple of 64 "
                             "(bitsandbytes 4-bit blocks)")
    if hidden_size % num_heads:
        raise ValueError(f"num_heads={num_heads}: must divide hidden_size={hidden_size}")
    if vocab_size < 512:
        raise ValueError(f"vocab_size={vocab_size}: must be >= 512 (256 bytes + merges + specials)")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    with atomic_folder(out_dir) as tmp:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        if dataset is None:  # 20k records fill a few thousand merges; more only costs time
            records: Iterable[dict[str, str]] = synthetic_records(20_000, seed)
        else:
            with open(dataset, encoding="utf-8") as f:
                records = [json.loads(line) for line in itertools.islice(f, 20_000)]
        tok.train_from_iterator((f"{r['instruction']}\n{r['input']}\n{r['output']}"
                                 for r in records), trainer=trainer)
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(  # Llama prepends BOS
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>", pad_token="<pad>", model_max_length=2048
                                ).save_pretrained(tmp)

        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=num_heads, max_position_embeddings=2048,
            bos_token_id=bos, eos_token_id=eos, pad_token_id=tok.token_to_id("<pad>"),
            tie_word_embeddings=False)
        # fork_rng: seeding must not disturb the caller's global torch RNG stream
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model.save_pretrained(tmp, safe_serialization=True)
    return out_dir


@dataclass(frozen=True)
class Assets:
    dataset: Path  # JSONL of synthetic records
    model_dir: Path  # the model folder as saved (safetensors + tokenizer)
    hub_root: Path  # what HubServer serves
    repo_id: str  # the model's id on that hub


def ensure_assets(home: str | os.PathLike[str] | None = None, *, model: str = "tiny") -> Assets:
    """Make (once) the embedded dataset and model, published into a local hub root."""
    if model not in MODEL_SIZES:
        raise ValueError(f"model={model!r}: allowed values are {', '.join(map(repr, MODEL_SIZES))}")
    base = (Path(home) if home is not None else diag_home()) / "assets"
    assets = Assets(dataset=base / f"dataset-{DATASET_MB}mb-seed0.jsonl",
                    model_dir=base / "models" / model, hub_root=base / "hub",
                    repo_id=f"diag-local/{model}-llama")
    marker = base / f"{model}.complete.json"  # written last: a complete set

    def complete() -> bool:
        return (marker.is_file() and assets.dataset.is_file()
                and (assets.model_dir / "model.safetensors").is_file())

    if complete():
        return assets
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank():
        # transformers 5 writes a model's weights on global rank 0 only once a process group is
        # up: another rank (another node's) makes them in a process without one
        code = "import sys; from diag.embedded import ensure_assets; " \
               "ensure_assets(sys.argv[1], model=sys.argv[2])"
        run = subprocess.run([sys.executable, "-c", code, str(base.parent), model],
                             capture_output=True, text=True, check=False)
        if run.returncode or not complete():
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"making the embedded assets in {base} failed: {last}")
        return assets
    from filelock import FileLock, Timeout

    base.mkdir(parents=True, exist_ok=True)
    # flock: the first process of this DIAG_HOME makes them, the others wait (the kernel frees it
    # if the holder dies) up to their own bound, apart from the collectives'
    lock, timeout = FileLock(base / ".fill.lock"), timeout_s("fill")
    try:
        lock.acquire(timeout=timeout)
    except Timeout:
        raise TimeoutError(f"waited {timeout:g} s for another process to make the embedded "
                           f"assets in {base}; raise DIAG_FILL_TIMEOUT_S if a first make takes "
                           "longer here") from None
    try:
        if not complete():
            for folder in (base, base / "models"):  # what a killed make left
                sweep_orphans(folder)
            if not assets.dataset.is_file():
                synthetic_dataset(assets.dataset, target_mb=DATASET_MB, seed=0)
            tiny_model(assets.model_dir, dataset=assets.dataset, **MODEL_SIZES[model])
            commit = publish_model(assets.model_dir, assets.hub_root, assets.repo_id)
            with atomic_file(marker) as tmp:
                tmp.write_text(json.dumps({"commit": commit,
                                           **{k: str(v) for k, v in vars(assets).items()}}))
    finally:
        lock.release()
    return assets


def embedded_dataset(size_mb: float, shards: int = 1) -> Path:
    """A synthetic JSONL dataset of size_mb (one file, or a folder of `shards` files), made once."""
    base = diag_home() / "storage"
    name = f"synthetic-{size_mb:g}mb"
    path = base / (f"{name}.jsonl" if shards == 1 else f"{name}-{shards}shards")
    if path.exists():
        return path
    sweep_orphans(base)  # what a killed make left half-written
    if shards == 1:
        return synthetic_dataset(path, target_mb=size_mb, seed=0)
    with atomic_folder(path, replace=False) as tmp:  # seeded: a concurrent make's is the same
        for i in range(shards):
            synthetic_dataset(tmp / f"shard-{i:05d}.jsonl", target_mb=size_mb / shards, seed=i)
    return path
