"""The whole job, projected: what `diag train` would take on every record of the source, from the
per-token costs a QLoRA comparison measured (`diag run`'s headline, a projection said as one).

`project_job(train, comparison, inputs)` prices each plan that ran with its costs
(diag.qlora.eta.from_runs, the token cache's recorded build rate beside them) times the counts of
the whole job `train` (a TrainConfig: its epochs, batch, eval share): the source's good records,
exact from a complete token cache, else counted as its lines or rows at the comparison's mean
tokens per record. `diag train --results runs/<id>` reads the same costs back and checks them on
the job it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diag.qlora.eta import from_runs, job_counts, project

if TYPE_CHECKING:
    import pandas as pd

    from diag.config import QLoraConfig, TrainConfig
    from diag.qlora.experiment import QLoraResult
    from diag.qlora.measure import JobInputs


@dataclass(frozen=True)
class Projection:
    """The whole job per plan (first field: the main table) and what each unit costs."""

    frame: pd.DataFrame  # plan, stage, predicted_s, evidence; per plan a `total` row first
    costs: pd.DataFrame  # diag.qlora.eta.COLUMNS: what `diag train --results` predicts from


def project_job(train: TrainConfig, job: QLoraConfig, comparison: QLoraResult,
                inputs: JobInputs) -> Projection:
    """Each plan of the comparison (of `job`, measured on `inputs`) over the whole job `train`."""
    import numpy as np
    import pandas as pd

    from diag.data import read_meta
    from diag.qlora.data import count_records, counted, job_records

    recs = job_records(job, inputs.data_path, inputs.model_dir)  # the comparison's: a hit
    meta = read_meta(recs.cache.folder) or {}
    every = counted(train, recs.cache).indices if recs.cache.complete else None
    records = len(every) if every is not None else count_records(inputs.data_path)
    landed, whole = _bytes(inputs.data_path), comparison.frame["source_bytes"].max()
    built = 0 if recs.cache.complete else landed  # bytes the whole job still has to tokenize
    if whole > landed > 0:  # the comparison landed only the shards its records were in: the
        records, every = round(records * whole / landed), None  # source's, by its bytes ("~")
        built = whole  # and no cache holds the source's
    per_record = float(np.minimum(recs.lengths, train.seq_len).mean())
    costs = from_runs(comparison.frame, comparison.stages, meta.get("build"))
    try:
        held = train.held_out(records)
    except ValueError as why:  # a source too small for one step of the whole job: said, not run
        return Projection(pd.DataFrame([{
            "plan": plan, "stage": "total", "predicted_s": float("nan"),
            "evidence": f"not projected: {records:,} records; {why}"}
            for plan in comparison.frame["plan"]]), costs)
    steps = train.total_steps((records - held) // train.batch_size)
    tokens_per_step = train.batch_size * per_record
    said = (f"{'' if every is not None else '~'}{records:,} records, "
            f"~{tokens_per_step * steps:,.0f} trained tokens, {steps:,} steps of "
            f"{train.batch_size} records, {steps * train.batch_size / (records - held):.3g} "
            "epoch(s)")
    frames = []
    for run in comparison.frame.itertuples():
        counts = job_counts(steps, train.warmup_steps, tokens_per_step,
                            tokens_per_step / (1 - run.padding_share),
                            train.cadence(train.eval_every, steps),
                            train.cadence(train.checkpoint_every, steps), held * train.seq_len,
                            built_bytes=built,
                            records=records)
        mine = project(costs[costs["plan"] == run.plan], counts)
        total = {"plan": run.plan, "stage": "total",
                 "predicted_s": float(mine["predicted_s"].dropna().sum()), "evidence": said}
        frames.append(pd.concat([pd.DataFrame([total]), mine], ignore_index=True))
    return Projection(pd.concat(frames, ignore_index=True), costs)


def _bytes(path: object) -> int:
    from diag.data import shard_files

    return sum(f.stat().st_size for f in shard_files(path))
