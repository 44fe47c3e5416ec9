"""Does `diag run --budget` keep its budget, and does a sampled pull extrapolate to the whole?

On the embedded S3 server with a ~1 GB dataset in many shards (synthetic JSONL, generated once
under DIAG_HOME, uploaded each run):
(a) `scale_extrapolation_error`: the storage experiment under a budget (its sample: a fraction
    of the shards, whole objects spread over their sizes) extrapolates the boto3-default pull
    of every object; the truth is the whole dataset pulled with boto3's defaults. ROUNDS rounds
    of a whole pull then a sampled run, and a whole pull after the last, so each estimate sits
    between two truths; a round's ratio is its estimate over the mean of the whole pulls either
    side of it (they share the round's load: across rounds and runs the box's load moves whole
    pulls of the same 1 GB 2-4x, within a round it does not), and the error is |median ratio - 1|,
    printed with every round's ratio, their spread and the sample's size.
(b) `scale_budget_ratio`: `python -m diag run --budget BUDGET --source <that prefix>` in a
    subprocess (the QLoRA job trains on that data), its wall time, interpreter start to exit,
    over the budget; its own estimated vs spent table is printed above.
Goals (last two lines): scale_extrapolation_error <= 0.1, scale_budget_ratio <= 1.1.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.config import StorageConfig, duration_s  # noqa: E402
from diag.embedded import S3Server, embedded_dataset  # noqa: E402
from diag.storage import list_remote, parse_url, pull, run_storage  # noqa: E402
from diag.storage.objectstore import MB, make_client  # noqa: E402
from diag.noise import compare, spread  # noqa: E402

SIZE_MB, SHARDS = 1024.0, 128  # 8 MB objects: many, each a few boto3 parts
STORAGE_BUDGET_S = 60.0  # the storage step's share
SAMPLE_MB = 160.0  # and at most this sample (~1/6 of the bytes): the estimate is an extrapolation
# sampled runs, each after a whole pull (and one after the last): a round's ratio spreads
# 0.6-1.4 at load ~4 (a sample pull is ~1 s here), so the median needs 7 of them
ROUNDS = int(os.environ.get("SCALE_ROUNDS", "7"))
BUDGET = os.environ.get("SCALE_BUDGET", "4m")  # the diag run's budget (a few minutes)


def whole_pull(client, url, objects, scratch: Path) -> float:
    """Seconds to pull every object with boto3's defaults, as the naive job start does."""
    dest = scratch / "whole"
    start = time.perf_counter()
    pull("boto3_default", client, url, objects, dest)
    seconds = time.perf_counter() - start
    shutil.rmtree(dest)
    return seconds


def main() -> None:
    data = embedded_dataset(SIZE_MB, SHARDS)  # made once, then reused
    with S3Server() as s3, tempfile.TemporaryDirectory(dir=data.parent) as scratch:
        client = make_client(s3.endpoint_url, credentials={
            "aws_access_key_id": s3.access_key, "aws_secret_access_key": s3.secret_key,
            "region_name": s3.region})
        s3.upload(data, "scale/")
        source = f"s3://{s3.bucket}/scale/"
        url = parse_url(source)
        objects = list_remote(client, url)
        nbytes = sum(o.size for o in objects)
        print(f"dataset: {nbytes / MB:.0f} MB in {len(objects)} objects at {source}")
        env = {**os.environ, **s3.env()}

        # (a) the sampled estimate vs the whole pull: rounds of a whole pull then a sampled
        # run, and a last whole pull, so each estimate sits between two truths (load drifts)
        os.environ.update(s3.env())  # the standard credential chain, as on a cloud box
        cfg = StorageConfig(source=source, endpoint_url=s3.endpoint_url, local_dir=scratch,
                            budget_s=STORAGE_BUDGET_S, sample_mb=SAMPLE_MB)
        wholes, estimates, pulls = [], [], None
        for _ in range(ROUNDS):
            wholes.append(whole_pull(client, url, objects, Path(scratch)))
            pulls = run_storage(cfg).frame.query("method == 'boto3_default'")
            estimates.append(statistics.median(pulls["extrapolated_s"]))
            print(f"whole pull {wholes[-1]:.3g} s; sampled estimate {estimates[-1]:.3g} s "
                  f"(repeats {pulls['extrapolated_s'].min():.3g}-"
                  f"{pulls['extrapolated_s'].max():.3g} s) from {pulls['sampled'].iloc[0]}",
                  flush=True)
        wholes.append(whole_pull(client, url, objects, Path(scratch)))
        truths = [(w0 + w1) / 2 for w0, w1 in zip(wholes, wholes[1:])]
        ratios = [e / t for e, t in zip(estimates, truths)]
        for i, (e, ratio) in enumerate(zip(estimates, ratios)):
            print(f"round {i}: estimate {e:.3g} s; whole pulls either side {wholes[i]:.3g}, "
                  f"{wholes[i + 1]:.3g} s; ratio {ratio:.3f}")
        error = abs(statistics.median(ratios) - 1)
        # a bias (the estimate low or high every round) resolves; noise stays within it
        print(f"per-round ratio (estimate / whole): median {statistics.median(ratios):.3f}, "
              f"{min(ratios):.3f}-{max(ratios):.3f}, interquartile {spread(ratios):.0%} of the "
              f"median, {sum(r < 1 for r in ratios)} of {len(ratios)} rounds low; estimates vs "
              f"whole pulls: {compare(truths, estimates).describe()}")

        # (b) the whole diagnosis under a budget, on the same data
        out = Path(scratch) / "run"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "diag", "run", "--budget", BUDGET,
                               "--source", source, "--endpoint-url", s3.endpoint_url,
                               "--out", str(out)], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"diag run failed ({done.returncode}): {done.stderr[-3000:]}")
        print(done.stdout)
        spent = pd.read_csv(out / "budget.csv")  # its own estimated vs spent, per step
        print(spent[["step", "estimated_s", "share_s", "spent_s"]].to_string(
            index=False, float_format=lambda v: f"{v:.1f}"))
        print(f"scale_extrapolation_error = {error:.3f} (goal <= 0.1; |median per-round ratio "
              f"- 1|, ratios {min(ratios):.3f}-{max(ratios):.3f} over {ROUNDS} rounds; sample "
              f"{pulls['bytes'].iloc[0] / MB:.0f} MB in {pulls['files'].iloc[0]} of "
              f"{len(objects)} objects, {pulls['bytes'].iloc[0] / nbytes:.1%} of the bytes, "
              f"{len(pulls)} repeats a run)")
        print(f"scale_budget_ratio = {wall / duration_s(BUDGET):.3f} (goal <= 1.1; diag run "
              f"--budget {BUDGET} took {wall:.0f} s, interpreter start to exit)")


if __name__ == "__main__":
    main()
