"""Write a deterministic synthetic instruction dataset (JSONL) of a given size or line count.

    python data/make_dataset.py --out big.jsonl --mb 500 --seed 0
    python data/make_dataset.py --out small.jsonl --records 10000

The same seed always gives the same bytes, so a dataset can be re-made instead of shipped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from diag.embedded.synth import synthetic_dataset  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write a synthetic instruction dataset as JSONL "
        '({"instruction", "input", "output"} per line).',
        epilog="Give exactly one of --mb or --records. Writing is atomic: tmp file, fsync, rename.",
    )
    parser.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--mb", type=float, help="approximate size in MB (10^6 bytes)")
    size.add_argument("--records", type=int, help="exact number of lines")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes (default 0)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        path = synthetic_dataset(args.out, records=args.records, target_mb=args.mb, seed=args.seed)
    except ValueError as e:  # a bad size is a usage error: say so, no traceback
        parser.error(str(e))
    mb = path.stat().st_size / 1e6
    print(f"wrote {path} ({mb:.1f} MB) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
