"""The DataLoader sweep: how long the loop waits for each batch, per num_workers and pipeline.

`measure_setting` runs one DataLoader against a step (emulated or real): the first batch
(worker start-up) is timed apart, the batches the workers prefetched during start-up are let
through untimed, then `steps` steady-state steps give data_wait per step and its share of the
step. A sample that raises fails its setting with the sample index and the original message
(the row's `error`); the sweep goes on. `sweep_workers(cfg)` runs every pipeline x num_workers,
in rounds of an epoch each, so a load that moves during the sweep hits them all.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from diag.machine.device import usable_cores  # affinity-aware: what workers share

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import LoaderConfig

COLUMNS = ["pipeline", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
           "samples_per_s", "tokens_per_s", "data_wait_s", "step_s", "data_wait_share",
           "first_batch_s", "repeat", "batch_size", "steps", "consumer", "warning", "error"]


class SampleError(RuntimeError):
    """A sample's preprocessing raised; the message names the sample index and the cause."""


class Guarded(Dataset):
    """Wraps a dataset: `extra_s` of added per-sample cost (a sleep: CPU-free, like I/O) and,
    for the fault tests, a sample index that raises; any error names the sample it came from."""

    def __init__(self, base: Dataset, extra_s: float = 0.0, fail_at: int | None = None) -> None:
        self.base, self.extra_s, self.fail_at = base, extra_s, fail_at

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        try:
            if self.extra_s:
                time.sleep(self.extra_s)
            if i == self.fail_at:
                raise ValueError(f"injected fault at sample {i}")
            return self.base[i]
        except Exception as err:
            raise SampleError(f"sample {i}: {type(err).__name__}: {err}") from err


@dataclass(frozen=True)
class Setting:
    """One DataLoader configuration."""

    num_workers: int
    pin_memory: bool = False
    persistent_workers: bool = True
    prefetch_factor: int = 2


def _cause(err: BaseException) -> str:
    """One line: the sample and the original message, without DataLoader's traceback dump."""
    if isinstance(err, SampleError) and "Original Traceback" not in str(err):
        return f"SampleError: {err}"
    # from a worker, DataLoader re-raises with the worker's traceback as the message
    for line in reversed(str(err).splitlines()):
        if "SampleError: " in line:
            return "SampleError: " + line.split("SampleError: ", 1)[1].strip()
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def batch_tokens(batch: Any) -> int | None:
    """Real tokens in a batch: its attention_mask's sum, else input_ids' size; None (count
    samples only) for a batch without them, e.g. an (x, y) tuple."""
    if isinstance(batch, Mapping):  # a dict, or HF collators' BatchEncoding (a Mapping)
        for key, count in (("attention_mask", lambda t: t.sum()),
                           ("input_ids", lambda t: t.numel())):
            if key in batch and isinstance(batch[key], torch.Tensor):
                return int(count(batch[key]))
    return None


def check_batch(batch: Any) -> None:
    """One clear error before the sweep, not a row per setting: diag moves and counts tensors."""
    parts = list(batch.values()) if isinstance(batch, Mapping) else list(batch) \
        if isinstance(batch, (tuple, list)) else [batch]
    wrong = [type(p).__name__ for p in parts if not isinstance(p, torch.Tensor)]
    if wrong or not parts:
        raise ValueError(f"dataset/collate_fn: a batch is a {type(batch).__name__} holding "
                         f"{', '.join(wrong) or 'nothing'}; allowed: a tensor, a tuple/list of "
                         "tensors ((x, y)) or a dict (any Mapping: HF collators' BatchEncoding) of "
                         "tensors; pass a collate_fn that makes one")


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Mapping):
        return {key: v.to(device, non_blocking=True) for key, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(v.to(device, non_blocking=True) for v in batch)
    return batch.to(device, non_blocking=True)


def measure_setting(dataset: Dataset, setting: Setting, step: Any, *, pipeline: str,
                    batch_size: int, steps: int, repeats: int = 1, timeout_s: float = 120.0,
                    device: torch.device | None = None, consumer: str = "emulated",
                    collate_fn: Any = None) -> list[dict[str, Any]]:
    """One row per repeat (an epoch of the same DataLoader): the steady-state figures."""
    with warnings.catch_warnings(), _heap_frozen():
        # torch warns of workers above its suggested count; the row's `warning` says it instead
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        return _measure(dataset, setting, step, pipeline, batch_size, steps, repeats, timeout_s,
                        device or torch.device("cpu"), consumer, collate_fn)


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """The collection that ends a setting passes over what the setting made, not the whole heap:
    the objects from before (the imported libraries and a loaded model, millions of them) are
    frozen out of it (gc.freeze) and given back after. A full pass over them took 0.6 s here, once
    per setting. Left as it is when the caller has frozen objects of its own."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _measure(dataset: Dataset, setting: Setting, step: Any, pipeline: str, batch_size: int,
             steps: int, repeats: int, timeout_s: float, device: torch.device, consumer: str,
             collate_fn: Any = None) -> list[dict[str, Any]]:
    from diag.machine.device import sync

    w = setting.num_workers
    ahead = w * setting.prefetch_factor  # ready or in flight when the first batch arrives
    n_batches = 1 + ahead + steps
    n = len(dataset)  # type: ignore[arg-type]
    indices = [i % n for i in range(n_batches * batch_size)]  # a small dataset is cycled
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=indices, num_workers=w, collate_fn=collate_fn,
        pin_memory=setting.pin_memory and device.type == "cuda",
        persistent_workers=setting.persistent_workers and w > 0,
        prefetch_factor=setting.prefetch_factor if w else None,
        timeout=timeout_s if w else 0,  # a hung worker fails the setting instead of the sweep
    )
    cores = usable_cores()
    warning = (f"num_workers={w} > {cores} usable cores: workers share cores, and the step's "
               "own host work competes with them" if w > cores else "")
    rows = []
    base = {"pipeline": pipeline, "num_workers": w, "pin_memory": setting.pin_memory,
            "persistent_workers": setting.persistent_workers,
            "prefetch_factor": setting.prefetch_factor if w else None, "batch_size": batch_size,
            "steps": steps, "consumer": consumer, "warning": warning}
    nan = float("nan")
    for repeat in range(repeats):
        waits, computes, tokens = [], [], 0
        first = nan
        try:
            start = time.perf_counter()
            batches = iter(loader)  # worker start-up (or, persistent, their reuse) starts here
            for k, batch in enumerate(itertools.islice(batches, n_batches)):
                got = time.perf_counter()
                if k == 0:
                    first = got - start
                if device.type == "cuda":
                    batch = _to(batch, device)
                    sync(device)  # note: sync point, so the copy is
                                  # billed to the step, not the wait
                step(batch)
                done = time.perf_counter()
                if k > ahead:  # steady state: start-up and the prefetched batches are past
                    waits.append(got - start)
                    computes.append(done - got)
                    counted = batch_tokens(batch)
                    tokens = None if counted is None or tokens is None else tokens + counted
                start = time.perf_counter()
            del batches
        except Exception as err:  # a worker's error arrives re-raised in this process
            rows.append({**base, **dict.fromkeys(COLUMNS[5:10], nan), "first_batch_s": first,
                         "repeat": repeat, "error": _cause(err)})
            break
        total = sum(waits) + sum(computes)
        rows.append({**base, "samples_per_s": len(waits) * batch_size / total,
                     "tokens_per_s": nan if tokens is None else tokens / total,
                     "data_wait_s": sum(waits) / len(waits),
                     "step_s": sum(computes) / len(computes),
                     "data_wait_share": sum(waits) / total, "first_batch_s": first,
                     "repeat": repeat, "error": ""})
    # persistent workers stop here, outside every timed interval; the loader and its iterator
    # refer to each other, so only the collector frees them, and a DataLoader forked while they
    # live would copy them into its workers (which then try to stop workers not theirs)
    del loader
    gc.collect()
    return rows


def records_needed(cfg: LoaderConfig) -> int:
    """Records the sweep's largest setting draws (its start-up, prefetched and timed batches)
    and the line profile reads: a pipeline's dataset holds no more (the sweep cycles a smaller
    one), so a measurement on a large source reads and tokenizes only these."""
    ahead = max(cfg.workers) * cfg.prefetch_factor
    return max(cfg.batch_size * (1 + ahead + cfg.steps), cfg.profile_samples)


def make_dataset(pipeline: str, cfg: LoaderConfig, data: str, tokenizer_dir: str
                 ) -> tuple[Dataset, dict[str, Any]]:
    """The pipeline's dataset for cfg over the source's first records_needed(cfg) records, and
    facts about how it was had (token cache status)."""
    from diag.data import NaiveTextDataset, PackedDataset, build_token_cache, read_source

    needed = records_needed(cfg)
    if pipeline == "naive":
        records, problems = read_source(data, cfg.fields(), on_error=cfg.on_error, limit=needed,
                                        cached=True)
        dataset: Dataset = NaiveTextDataset(records, tokenizer_dir, cfg.seq_len)
        facts = {"records": len(records), "bad_rows": len(problems)}
    else:
        cache = build_token_cache(data, tokenizer_dir, fields=cfg.fields(), num_proc=cfg.num_proc,
                                  on_error=cfg.on_error, limit=needed)
        records = min(needed, cache.records)
        dataset = PackedDataset(cache.folder, cfg.seq_len, records=range(records))
        facts = {"records": records, "bad_rows": cache.skipped,
                 "cache": cache.status, "cache_s": cache.seconds, "cache_folder": str(cache.folder)}
    return Guarded(dataset, cfg.extra_prep_ms / 1000), facts


def sources(cfg: LoaderConfig) -> tuple[str, str]:
    """(records, tokenizer folder): the user's (a file or folder of shards, read with cfg's
    record fields), or the embedded dataset and tiny model."""
    if cfg.data and cfg.tokenizer:
        return cfg.data, cfg.tokenizer
    from diag.embedded import ensure_assets

    assets = ensure_assets()
    return cfg.data or str(assets.dataset), cfg.tokenizer or str(assets.model_dir)


def sweep_workers(cfg: LoaderConfig | None = None, step: Any = None, *,
                  dataset: Dataset | None = None, collate_fn: Any = None) -> pd.DataFrame:
    """Every pipeline x num_workers against the step: one row per repeat (see COLUMNS).

    step: (callable, nominal seconds, where they came from), as diag.loader.steps.consumer
    gives, or just your callable(batch); None makes it from cfg (an emulated step may first
    measure the tiny model's). dataset: your own map-style Dataset (with collate_fn), swept
    as pipeline "yours" instead of cfg's pipelines; tokens are counted when a batch has
    attention_mask or input_ids, samples always.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from diag.config import LoaderConfig
    from diag.loader.steps import consumer
    from diag.machine.device import resolve
    from diag.noise import interleave

    cfg = cfg or LoaderConfig.default()
    device = resolve(cfg.device)
    if callable(step):
        step = (step, float("nan"), "yours")
    if dataset is not None:
        if step is None:
            raise ValueError("sweep_workers(dataset=...): pass step=your_step(batch) too")
        check_batch(next(iter(torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size,
                                                          collate_fn=collate_fn))))
        datasets = {"yours": (dataset, {"records": len(dataset), "bad_rows": 0})}
    else:
        data, tokenizer_dir = sources(cfg)
        step = step or consumer(cfg, tokenizer_dir, device)
        datasets = {p: make_dataset(p, cfg, data, tokenizer_dir) for p in cfg.pipelines}
    run_step, step_s, step_source = step
    extra = {"seq_len": cfg.seq_len, "step_target_s": step_s, "step_source": step_source,
             "cores": usable_cores()}
    grid = [(p, w) for p in datasets for w in cfg.workers]
    failed: set[tuple[str, int]] = set()

    def epoch(side: tuple[str, int], repeat: int) -> dict[str, Any] | None:
        """An epoch of one setting, a DataLoader of its own (never two alive: a worker forked
        while another's live copies them)."""
        bar.update()
        if side in failed:
            return None
        (pipeline, w), (dataset, facts) = side, datasets[side[0]]
        setting = Setting(w, cfg.pin_memory, cfg.persistent_workers, cfg.prefetch_factor)
        (row,) = measure_setting(dataset, setting, run_step, pipeline=pipeline,
                                 batch_size=cfg.batch_size, steps=cfg.steps,
                                 timeout_s=cfg.timeout_s, device=device, consumer=cfg.consumer,
                                 collate_fn=collate_fn)
        if row["error"]:
            failed.add(side)
        return {**row, **extra, "repeat": repeat, "records": facts["records"],
                "bad_rows": facts["bad_rows"], "token_cache": facts.get("cache", "")}

    # rounds of an epoch per setting, the order turned every round (diag.noise.interleave): a
    # load that moves during the sweep hits every setting
    with tqdm(total=len(grid) * cfg.repeats, desc="loader sweep", unit="epoch",
              leave=False) as bar:
        got, _ = interleave(grid, epoch, min_rounds=cfg.repeats, max_rounds=cfg.repeats)
    rows = [r for side in grid for r in got[side] if r is not None]
    return pd.DataFrame(rows, columns=COLUMNS + [*extra, "records", "bad_rows", "token_cache"])
