"""The DataLoader sweep: how long the loop waits for each batch, per num_workers and pipeline,
in steady state (start-up apart); a sample that raises fails its setting, naming the sample."""
from __future__ import annotations

import contextlib
import gc
import itertools
import time
import warnings
from collections.abc import Iterator, Mapping
from statistics import fmean
from typing import Any, NamedTuple

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from diag.config import LoaderConfig
from diag.data import NaiveTextDataset, PackedDataset, build_token_cache, read_source
from diag.embedded import ensure_assets
from diag.loader.toy import consumer
from diag.machine.device import resolve, sync, usable_cores  # usable: affinity-aware
from diag.noise import interleave

COLUMNS = ["pipeline", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
           "samples_per_s", "tokens_per_s", "data_wait_s", "step_s", "data_wait_share",
           "first_batch_s", "repeat", "batch_size", "steps", "consumer", "warning", "error"]


class SampleError(RuntimeError):
    """A sample's preprocessing raised; the message names the sample index and the cause."""


class Guarded(Dataset):
    """A dataset, `extra_s` asleep per sample (like I/O), fail_at raising; errors name a sample."""

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


class Setting(NamedTuple):  # one DataLoader configuration
    num_workers: int
    pin_memory: bool = False
    persistent_workers: bool = True
    prefetch_factor: int = 2


def batch_tokens(batch: Any) -> int | None:
    """Real tokens in a batch: attention_mask's sum, else input_ids' size; None for neither."""
    if not isinstance(batch, Mapping):  # a dict, or HF collators' BatchEncoding (a Mapping)
        return None
    mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    return int(mask.sum()) if isinstance(mask, torch.Tensor) else ids.numel() if isinstance(
        ids, torch.Tensor) else None


def _to(batch: Any, device: torch.device) -> Any:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return {k: move(v) for k, v in batch.items()} if isinstance(batch, Mapping) else type(batch)(
        map(move, batch)) if isinstance(batch, (tuple, list)) else move(batch)


@contextlib.contextmanager
def _one_setting() -> Iterator[None]:
    """Silences torch's too-many-workers warning (rows say it); freezes the heap unless frozen."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        frozen = not gc.get_freeze_count()
        if frozen:
            gc.freeze()
        try:
            yield
        finally:
            if frozen:
                gc.unfreeze()


@_one_setting()
def measure_setting(dataset: Dataset, setting: Setting, step: Any, *, pipeline: str,
                    batch_size: int, steps: int, repeats: int = 1, timeout_s: float = 120.0,
                    device: torch.device | None = None, consumer: str = "emulated",
                    collate_fn: Any = None) -> list[dict[str, Any]]:
    """One row per repeat (an epoch of the same DataLoader): the steady-state figures."""
    device = device or torch.device("cpu")
    cuda, w, n = device.type == "cuda", setting.num_workers, len(dataset)  # type: ignore[arg-type]
    ahead = w * setting.prefetch_factor  # ready or in flight when the first batch arrives
    n_batches = 1 + ahead + steps
    loader = DataLoader(  # a small dataset is cycled
        dataset, batch_size=batch_size, sampler=[i % n for i in range(n_batches * batch_size)],
        num_workers=w, collate_fn=collate_fn, pin_memory=setting.pin_memory and cuda,
        persistent_workers=setting.persistent_workers and w > 0,
        prefetch_factor=setting.prefetch_factor if w else None,
        timeout=timeout_s if w else 0)  # a hung worker fails the setting instead of the sweep
    cores, rows, nan = usable_cores(), [], float("nan")
    base = {"pipeline": pipeline, "num_workers": w, "pin_memory": setting.pin_memory,
            "persistent_workers": setting.persistent_workers,
            "prefetch_factor": setting.prefetch_factor if w else None, "batch_size": batch_size,
            "steps": steps, "consumer": consumer, "warning": f"num_workers={w} > {cores} usable "
            "cores: workers share cores, and the step's own host work competes with them"
            if w > cores else ""}
    for repeat in range(repeats):
        waits, computes, tokens, first = [], [], 0, nan
        try:
            start = time.perf_counter()
            batches = iter(loader)  # worker start-up (or, persistent, their reuse) starts here
            for k, batch in enumerate(itertools.islice(batches, n_batches)):
                got = time.perf_counter()
                first = got - start if k == 0 else first
                if cuda:
                    batch = _to(batch, device)
                    sync(device)  # note: sync point: the copy is billed to the step, not the wait
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
            # one line: the sample and the message, without the worker's traceback DataLoader adds
            lines = f"{type(err).__name__}: {err}".strip().splitlines()
            said = [ln.split("SampleError: ", 1)[1] for ln in lines if "SampleError: " in ln]
            rows.append({**base, **dict.fromkeys(COLUMNS[5:10], nan), "first_batch_s": first,
                         "repeat": repeat, "error": f"SampleError: {said[-1].strip()}"
                         if said else lines[0]})
            break
        total = sum(waits) + sum(computes)
        rows.append({**base, "samples_per_s": len(waits) * batch_size / total,
                     "tokens_per_s": nan if tokens is None else tokens / total,
                     "data_wait_s": fmean(waits), "step_s": fmean(computes),
                     "data_wait_share": sum(waits) / total, "first_batch_s": first,
                     "repeat": repeat, "error": ""})
    # persistent workers stop here, untimed; only the collector frees the loader (its iterator
    # refers back), and a DataLoader forked while they live would copy them into its workers
    del loader
    gc.collect()
    return rows


def records_needed(cfg: LoaderConfig) -> int:
    """Records the largest setting draws and the line profile reads: a source is read this far."""
    ahead = max(cfg.workers) * cfg.prefetch_factor  # ready or in flight at the first batch
    return max(cfg.batch_size * (1 + ahead + cfg.steps), cfg.profile_samples)


def make_dataset(pipeline: str, cfg: LoaderConfig, data: str, tokenizer_dir: str
                 ) -> tuple[Dataset, dict[str, Any]]:
    """The pipeline's dataset over the first records_needed(cfg) records, and its facts."""
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
        facts = {"records": records, "bad_rows": cache.skipped, "cache": cache.status}
    return Guarded(dataset, cfg.extra_prep_ms / 1000), facts


def sources(cfg: LoaderConfig) -> tuple[str, str]:
    """(records, tokenizer folder): the user's, or the embedded dataset and tiny model."""
    if cfg.data and cfg.tokenizer:
        return cfg.data, cfg.tokenizer
    assets = ensure_assets()
    return cfg.data or str(assets.dataset), cfg.tokenizer or str(assets.model_dir)


def sweep_workers(cfg: LoaderConfig | None = None, step: Any = None, *,
                  dataset: Dataset | None = None, collate_fn: Any = None) -> pd.DataFrame:
    """Every pipeline x num_workers against the step, a row per repeat, in interleaved rounds."""
    cfg = cfg or LoaderConfig.default()
    device = resolve(cfg.device)
    if callable(step):
        step = (step, float("nan"), "yours")
    if dataset is not None:
        if step is None:
            raise ValueError("sweep_workers(dataset=...): pass step=your_step(batch) too")
        # one clear error before the sweep, not one per setting: diag moves and counts tensors
        batch = next(iter(DataLoader(dataset, batch_size=cfg.batch_size, collate_fn=collate_fn)))
        parts = list(batch.values()) if isinstance(batch, Mapping) else list(batch) \
            if isinstance(batch, (tuple, list)) else [batch]
        wrong = [type(p).__name__ for p in parts if not isinstance(p, torch.Tensor)]
        if wrong or not parts:
            raise ValueError(f"dataset/collate_fn: a batch is a {type(batch).__name__} "
                             f"holding {', '.join(wrong) or 'nothing'}; allowed: a tensor, a "
                             "tuple/list of tensors ((x, y)) or a dict (any Mapping: HF "
                             "collators' BatchEncoding) of tensors; pass a collate_fn that makes "
                             "one")
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
        # a DataLoader of its own: a worker forked while another's live would copy them
        bar.update()
        if side in failed:
            return None
        (pipeline, w), (dataset, facts) = side, datasets[side[0]]
        (row,) = measure_setting(
            dataset, Setting(w, cfg.pin_memory, cfg.persistent_workers, cfg.prefetch_factor),
            run_step, pipeline=pipeline, batch_size=cfg.batch_size, steps=cfg.steps,
            timeout_s=cfg.timeout_s, device=device, consumer=cfg.consumer, collate_fn=collate_fn)
        if row["error"]:
            failed.add(side)
        return {**row, **extra, "repeat": repeat, "records": facts["records"],
                "bad_rows": facts["bad_rows"], "token_cache": facts.get("cache", "")}

    # the order turned every round: a load that moves during the sweep hits every setting
    with tqdm(total=len(grid) * cfg.repeats, desc="loader sweep", unit="epoch", leave=False) as bar:
        got, _ = interleave(grid, epoch, min_rounds=cfg.repeats, max_rounds=cfg.repeats)
    rows = [r for side in grid for r in got[side] if r is not None]
    return pd.DataFrame(rows, columns=COLUMNS + [*extra, "records", "bad_rows", "token_cache"])
