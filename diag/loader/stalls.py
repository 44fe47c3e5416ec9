"""Where the data stall comes from, after DS-Analyzer's differential method (Mohan et al., 2021).

The same loop runs three times at one DataLoader setting: (1) synthetic batches already in
memory, no data path: the loop's own floor; (2) real data with the files in the page cache:
adds preprocessing (prep stall = warm - synthetic); (3) real data after the files were dropped
from the page cache: adds the reads (fetch stall = cold - warm). One row per pipeline, seconds
per step and shares of a step; `open_*_s` is what making the dataset took (a naive dataset
reads its records there, a packed one checks its token cache's key).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from diag.loader.sweep import Guarded, Setting, make_dataset, measure_setting, sources

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import LoaderConfig

COLUMNS = ["pipeline", "num_workers", "synthetic_wait_s", "warm_wait_s", "cold_wait_s",
           "prep_stall_s", "fetch_stall_s", "step_s", "prep_stall_share", "fetch_stall_share",
           "open_warm_s", "open_cold_s", "cache_state", "error"]


class SyntheticSamples(Dataset):
    """The same sample every time, made once: the loop with no data path at all."""

    def __init__(self, sample: dict[str, torch.Tensor], n: int) -> None:
        self.sample, self.n = sample, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.sample


def _files(pipeline: str, data: str, dataset: Dataset) -> tuple[list[Path], list[Path]]:
    """(the record files: the file, or each shard of a folder; for packed the token cache's
    arrays): what the pipeline reads."""
    from diag.data import ARRAYS, shard_files

    base = dataset.base if isinstance(dataset, Guarded) else dataset
    return shard_files(data), [base.folder / f for f in ARRAYS] if pipeline == "packed" else []


def _read_all(paths: list[Path]) -> None:
    for path in paths:  # into the page cache: the "warm" state
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass


def stall_split(cfg: LoaderConfig | None = None, num_workers: int | None = None,
                step: Any = None) -> pd.DataFrame:
    """Synthetic / warm / cold runs per pipeline at num_workers (default: cfg.workers[0])."""
    import pandas as pd

    from diag.config import LoaderConfig
    from diag.machine.device import resolve
    from diag.machine.disks import evict_page_cache
    from diag.loader.steps import EmulatedStep, consumer

    cfg = cfg or LoaderConfig.default()
    data, tokenizer_dir = sources(cfg)
    device = resolve(cfg.device)
    if step is None:
        step, _, _ = consumer(cfg, tokenizer_dir, device)
    w = cfg.workers[0] if num_workers is None else num_workers
    nominal = None
    if w == 0 and isinstance(step, EmulatedStep):
        # no workers: each batch is made in this process between steps, so the step's length
        # cannot change the wait; the step is accounted at its seconds instead of slept
        nominal, step = step.seconds, copy.copy(step)
        step.hold = False
    setting = Setting(w, cfg.pin_memory, cfg.persistent_workers, cfg.prefetch_factor)
    common = {"batch_size": cfg.batch_size, "steps": cfg.steps, "timeout_s": cfg.timeout_s,
              "device": device, "consumer": cfg.consumer}
    rows = []
    for pipeline in cfg.pipelines:
        waits: dict[str, float] = {}
        opened: dict[str, float] = {}
        errors, label, steps_s = [], "", []
        records, arrays = _files(pipeline, data,
                                 make_dataset(pipeline, cfg, data, tokenizer_dir)[0])
        for state in ("warm", "cold", "synthetic"):
            if state == "cold":
                # a live memory map pins its pages in the cache: drop the warm run's first
                dataset = None  # type: ignore[assignment]
                label = evict_page_cache(records + arrays)  # "cold", or says why it is not
            elif state == "warm":
                # the records are warm: the dataset made above read what it reads of them (the
                # first records, not a large source's every shard)
                _read_all(arrays)
            start = time.perf_counter()
            if state != "synthetic":
                dataset, _ = make_dataset(pipeline, cfg, data, tokenizer_dir)
                opened[state] = time.perf_counter() - start
            else:
                dataset = SyntheticSamples(dataset[0], len(dataset))  # type: ignore[arg-type]
            got = measure_setting(dataset, setting, step, pipeline=pipeline, **common)[0]
            waits[state] = got["data_wait_s"]
            steps_s.append(got["step_s"])
            if got["error"]:
                errors.append(f"{state}: {got['error']}")
        step_s = float(pd.Series(steps_s).median()) if nominal is None else nominal
        prep = max(waits["warm"] - waits["synthetic"], 0.0)
        fetch = max(waits["cold"] - waits["warm"], 0.0)
        per_step = step_s + waits["cold"]
        rows.append({"pipeline": pipeline, "num_workers": w,
                     "synthetic_wait_s": waits["synthetic"], "warm_wait_s": waits["warm"],
                     "cold_wait_s": waits["cold"], "prep_stall_s": prep, "fetch_stall_s": fetch,
                     "step_s": step_s, "prep_stall_share": prep / per_step,
                     "fetch_stall_share": fetch / per_step, "open_warm_s": opened["warm"],
                     "open_cold_s": opened["cold"], "cache_state": label,
                     "error": "; ".join(errors)})
    return pd.DataFrame(rows, columns=COLUMNS)
