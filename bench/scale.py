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
    `scale_extrapolation_error_one_object`: the same on one 512 MB object, which the storage
    experiment samples by byte ranges spread over it (s5cmd, which takes no range, unmeasured).
(b) `scale_budget_ratio`: `python -m diag run --budget BUDGET --source <that prefix>` in a
    subprocess (the QLoRA job trains on that data), its wall time, interpreter start to exit,
    over the budget; its own estimated vs spent table is printed above.
Goals (last three lines): both scale_extrapolation_error <= 0.1, scale_budget_ratio <= 1.1.
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
# one object sampled by byte ranges: 512 MB, 9 ranges of 59 MB (7 parts of 8 MiB each), of which
# the sample pulls 2 (10 parts fill boto3's 10 threads); one measured pull per method a run: on
# the embedded server every GET reads the whole object, so a 512 MB pull is ~64 of them (~50 s)
ONE_MB, ONE_ROUND = 512.0, {"repeats": 1, "warmup": 0}
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


def extrapolation(s3, client, data: Path, key: str, scratch: Path, **sample) -> dict:
    """(a) on `data` uploaded at key: ROUNDS rounds of a whole pull then a sampled run, a whole
    pull after the last; each round's estimate over the mean of the whole pulls either side."""
    s3.upload(data, key)
    source = f"s3://{s3.bucket}/{key}"
    url = parse_url(source)
    objects = list_remote(client, url)
    nbytes = sum(o.size for o in objects)
    print(f"dataset: {nbytes / MB:.0f} MB in {len(objects)} object(s) at {source}")
    cfg = StorageConfig(source=source, endpoint_url=s3.endpoint_url, local_dir=str(scratch),
                        **sample)
    wholes, estimates, pulls = [], [], None
    for _ in range(ROUNDS):
        wholes.append(whole_pull(client, url, objects, scratch))
        pulls = run_storage(cfg).frame.query("method == 'boto3_default'")
        estimates.append(statistics.median(pulls["extrapolated_s"]))
        print(f"whole pull {wholes[-1]:.3g} s; sampled estimate {estimates[-1]:.3g} s "
              f"(repeats {pulls['extrapolated_s'].min():.3g}-"
              f"{pulls['extrapolated_s'].max():.3g} s) from {pulls['sampled'].iloc[0]}; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    wholes.append(whole_pull(client, url, objects, scratch))
    truths = [(w0 + w1) / 2 for w0, w1 in zip(wholes, wholes[1:])]
    ratios = [e / t for e, t in zip(estimates, truths)]
    for i, (e, ratio) in enumerate(zip(estimates, ratios)):
        print(f"round {i}: estimate {e:.3g} s; whole pulls either side {wholes[i]:.3g}, "
              f"{wholes[i + 1]:.3g} s; ratio {ratio:.3f}")
    # a bias (the estimate low or high every round) resolves; noise stays within it
    print(f"per-round ratio (estimate / whole): median {statistics.median(ratios):.3f}, "
          f"{min(ratios):.3f}-{max(ratios):.3f}, interquartile {spread(ratios):.0%} of the "
          f"median, {sum(r < 1 for r in ratios)} of {len(ratios)} rounds low; estimates vs "
          f"whole pulls: {compare(truths, estimates).describe()}")
    return {"error": abs(statistics.median(ratios) - 1), "ratios": ratios, "objects": objects,
            "bytes": nbytes, "sample_mb": pulls["bytes"].iloc[0] / MB,
            "pieces": pulls["files"].iloc[0], "repeats": len(pulls),
            "load": os.getloadavg()}


def said(name: str, got: dict) -> str:
    ratios, one = got["ratios"], len(got["objects"]) == 1
    pieces = (f"{got['pieces']} byte ranges of the one object" if one else
              f"{got['pieces']} of {len(got['objects'])} objects")
    return (f"{name} = {got['error']:.3f} (goal <= 0.1; |median per-round ratio - 1|, ratios "
            f"{min(ratios):.3f}-{max(ratios):.3f} over {ROUNDS} rounds; sample "
            f"{got['sample_mb']:.0f} MB in {pieces}, {got['sample_mb'] * MB / got['bytes']:.1%}"
            f" of the bytes, {got['repeats']} repeats a run; load average "
            + "/".join(f"{v:.1f}" for v in got["load"]) + ")")


def main() -> None:
    shards = embedded_dataset(SIZE_MB, SHARDS)  # made once, then reused
    one = embedded_dataset(ONE_MB)
    with S3Server() as s3, tempfile.TemporaryDirectory(dir=shards.parent) as scratch:
        client = make_client(s3.endpoint_url, credentials={
            "aws_access_key_id": s3.access_key, "aws_secret_access_key": s3.secret_key,
            "region_name": s3.region})
        os.environ.update(s3.env())  # the standard credential chain, as on a cloud box
        env = {**os.environ}
        # (a) the sampled estimate vs the whole pull: many shards, then one object by ranges
        many = extrapolation(s3, client, shards, "scale/", Path(scratch),
                             budget_s=STORAGE_BUDGET_S, sample_mb=SAMPLE_MB)
        single = extrapolation(s3, client, one, "one/data.jsonl", Path(scratch),
                               budget_s=STORAGE_BUDGET_S, sample_mb=SAMPLE_MB, **ONE_ROUND)

        # (b) the whole diagnosis under a budget, on the shards
        out = Path(scratch) / "run"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "diag", "run", "--budget", BUDGET,
                               "--source", f"s3://{s3.bucket}/scale/", "--endpoint-url",
                               s3.endpoint_url, "--out", str(out)], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"diag run failed ({done.returncode}): {done.stderr[-3000:]}")
        print(done.stdout)
        spent = pd.read_csv(out / "budget.csv")  # its own estimated vs spent, per step
        print(spent[["step", "estimated_s", "share_s", "spent_s"]].to_string(
            index=False, float_format=lambda v: f"{v:.1f}"))
        print(said("scale_extrapolation_error", many))
        print(said("scale_extrapolation_error_one_object", single))
        print(f"scale_budget_ratio = {wall / duration_s(BUDGET):.3f} (goal <= 1.1; diag run "
              f"--budget {BUDGET} took {wall:.0f} s, interpreter start to exit; load average "
              + "/".join(f"{v:.1f}" for v in os.getloadavg()) + ")")


if __name__ == "__main__":
    main()
