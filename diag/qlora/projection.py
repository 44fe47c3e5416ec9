"""The whole job, projected: what `diag train` would take on every record of the source, priced
at the wall costs the comparison's runs measured (the rows `diag train --results` prices at)."""


from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    from diag.config import QLoraConfig, TrainConfig
    from diag.qlora.experiment import QLoraResult
    from diag.qlora.measure import JobInputs


@dataclass(frozen=True)
class Projection:
    """The whole job per plan (first field: the main table) and the costs it priced."""

    frame: pd.DataFrame  # plan, stage, seconds, low, high, evidence; per plan `total` first
    costs: pd.DataFrame  # the rows priced (diag.forecast.costs.COLUMNS): what an ETA reads


def project_job(train: TrainConfig, job: QLoraConfig, comparison: QLoraResult,
                inputs: JobInputs) -> Projection:
    """Each plan of the comparison (of `job`, measured on `inputs`) over the whole job `train`."""
    import numpy as np
    import pandas as pd
    from diag.data import read_meta, shard_files
    from diag.forecast.costs import measured, price, row, table
    from diag.forecast.eta import job_counts, runs_costs
    from diag.qlora.data import count_records, counted, job_records

    recs = job_records(job, inputs.data_path, inputs.model_dir)  # the comparison's: a hit
    build = (read_meta(recs.cache.folder) or {}).get("build") or {}
    every = counted(train, recs.cache).indices if recs.cache.complete else None
    records = len(every) if every is not None else count_records(inputs.data_path)
    landed = sum(f.stat().st_size for f in shard_files(inputs.data_path))
    whole = int(comparison.frame["source_bytes"].max())
    built = 0 if recs.cache.complete else landed  # bytes the whole job still has to tokenize
    exact = every is not None
    if whole > landed > 0:  # the comparison landed only the shards its records were in
        records, built, exact = round(records * whole / landed), whole, False
    per_record = float(np.minimum(recs.lengths, train.seq_len).mean())
    try:
        held = train.held_out(records)
    except ValueError as why:  # a source too small for one step of the whole job: said
        return Projection(pd.DataFrame([{"plan": p, "stage": "total", "seconds": float("nan"),
                                         "evidence": f"not projected: {records:,} records; {why}"}
                                        for p in comparison.frame["plan"]]), comparison.costs)
    steps = train.total_steps((records - held) // train.batch_size)
    per_step = train.batch_size * per_record
    epochs = steps * train.batch_size / (records - held)
    said = (f"{'' if exact else '~'}{records:,} records, ~{per_step * steps:,.0f} trained "
            f"tokens, {steps:,} steps of {train.batch_size} records, {epochs:.3g} "
            f"epoch{'s' * (round(epochs, 3) != 1)}")
    frames, priced = [], []
    for run in comparison.frame.itertuples():
        counts = job_counts(steps, train.warmup_steps, per_step, per_step / (1 - run.padding_share),
                            train.eval_cadence(steps, held),
                            train.cadence(train.checkpoint_every, steps), held * train.seq_len,
                            built_bytes=built, records=records)
        costs = runs_costs(comparison.costs, run.plan)
        if build.get("bytes") and build.get("seconds") and run.plan == "optimized":
            rate = f"{build['bytes'] / build['seconds'] / 1e6:.3g} MB/s"  # a byte tokenized (wall)
            byte = row(run.plan, "preprocess", "byte", build["seconds"], build["bytes"],
                       evidence=f"the token cache's recorded build: {rate} with "
                                f"{build.get('processes', '?')} processes")
            costs = pd.concat([costs, table(measured([byte]))], ignore_index=True)
        priced.append(costs)
        mine = price(costs, counts)
        total = {"plan": run.plan, "stage": "total", "seconds": float(mine["seconds"].sum()),
                 "low": float(mine["low"].sum()), "high": float(mine["high"].sum()),
                 "evidence": said}
        frames.append(pd.concat([pd.DataFrame([total]), mine], ignore_index=True))
    return Projection(pd.concat(frames, ignore_index=True), pd.concat(priced, ignore_index=True))
