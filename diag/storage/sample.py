"""A sample spanning a dataset's sizes (`spread` of objects or `ranges`, pulled by `probe`), and
the whole pull extrapolated (`Extrapolation`: seconds = pieces x overhead + bytes / rate).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from diag.storage.objectstore import MB, RemoteObject, transfer_plan

RANGES_AT_LEAST = 8  # a one-object source is cut into at least this many ranges to spread over
RANGE_SAMPLE_AT_LEAST = 10 * 8 * 2**20  # its sample's least bytes: boto3's 10 parts of 8 MiB


@dataclass(frozen=True)
class Range:
    """Bytes [start, start + size) of one object: a piece of a one-object source's sample."""

    obj: RemoteObject
    start: int
    size: int

    @property
    def key(self) -> str:
        return self.obj.key

    @property
    def name(self) -> str:  # the file its bytes land in: the object's name, the HTTP range
        return f"{self.key.rsplit('/', 1)[-1]}.bytes-{self.start}-{self.start + self.size - 1}"


def ranges(obj: RemoteObject) -> list[Range]:
    """The object cut into ranges of whole parts of both boto3 pulls (at least RANGES_AT_LEAST)."""
    step = min(transfer_plan(obj.size).part_bytes, max(1, obj.size // RANGES_AT_LEAST))
    if step >= 8 * 2**20:  # whole 8 MiB parts: boto3's default pull makes as many requests a byte
        step -= step % (8 * 2**20)
    return [Range(obj, a, min(step, obj.size - a)) for a in range(0, obj.size, step)]


def spread(objects: list[Any]) -> list[Any]:
    """Every piece once, each prefix spread over the sizes (sorted positions 1/2, 1/4, 3/4, ...)."""
    ranked = sorted(objects, key=lambda o: (o.size, o.key))
    n, seen, out, depth = len(ranked), set(), [], 0
    while len(out) < n:  # at depth d the positions are n/2^d apart: all are hit once 2^d >= n
        for k in range(2 ** depth):
            i = min(n - 1, (2 * k + 1) * n // 2 ** (depth + 1))
            if i not in seen:
                seen.add(i)
                out.append(ranked[i])
        depth += 1
    return out


def probe(ordered: list[Any], pull_one: Callable[[Any, int], None],
          seconds: float, cap_bytes: int, least: int = 0) -> pd.DataFrame:
    """pull_one(piece, bytes before) until `seconds` and `least` bytes, or cap_bytes: rows."""
    rows, total, spent = [], 0, 0.0
    for obj in ordered:
        full = cap_bytes and total + obj.size > cap_bytes
        if rows and ((seconds and spent >= seconds and total >= least) or full):
            break
        start = time.perf_counter()
        pull_one(obj, total)
        took = time.perf_counter() - start
        total, spent = total + obj.size, spent + took
        rows.append({"key": obj.key, **({"start": obj.start} if isinstance(obj, Range) else {}),
                     "bytes": obj.size, "seconds": took, "sample_bytes": total,
                     "sample_seconds": spent, "sample_mb_per_s": total / MB / spent
                     if spent > 0 else float("nan")})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Extrapolation:
    """A sample's pull turned into the whole dataset's, fitted on the probe's pieces."""

    sample_bytes: int
    sample_files: int  # pieces pulled: objects, or ranges of the one object
    dataset_bytes: int
    dataset_files: int  # objects in the dataset
    overhead_s: float  # per piece (requests, connection): what a larger piece does not dilute
    bytes_per_s: float  # the rate once a piece streams
    settle: float  # how far the cumulative rate moved over the sample's second half (0.03: 3%)
    range_bytes: int = 0  # the ranges' size when the sample is ranges of one object; 0: objects

    @classmethod
    def fit(cls, sample: pd.DataFrame, dataset_bytes: int, dataset_files: int,
            range_bytes: int = 0) -> Extrapolation:
        size, secs = sample["bytes"].to_numpy(float), sample["seconds"].to_numpy(float)
        overhead, rate = 0.0, size.sum() / max(secs.sum(), 1e-9)
        if len(set(size)) > 1:  # two sizes or more: the intercept is the per-piece overhead
            slope, intercept = np.polyfit(size, secs, 1)
            if slope > 0 and intercept >= 0:
                overhead, rate = float(intercept), 1 / float(slope)
        cum = sample["sample_mb_per_s"].to_numpy(float)
        half = int(np.searchsorted(sample["sample_bytes"].to_numpy(), size.sum() / 2))
        settle = abs(cum[-1] - cum[min(half, len(cum) - 1)]) / cum[-1] if cum[-1] > 0 else 0.0
        return cls(int(size.sum()), len(sample), dataset_bytes, dataset_files, overhead, rate,
                   float(settle), range_bytes)

    @property
    def whole(self) -> bool:  # the sample is every byte: nothing is extrapolated
        return self.sample_bytes >= self.dataset_bytes

    @property
    def factor(self) -> float:  # the whole pull's seconds over the sample's, by the fit
        if self.whole:
            return 1.0
        pieces = (-(-self.dataset_bytes // self.range_bytes) if self.range_bytes
                  else self.dataset_files)
        whole = pieces * self.overhead_s + self.dataset_bytes / self.bytes_per_s
        part = self.sample_files * self.overhead_s + self.sample_bytes / self.bytes_per_s
        return whole / part

    def label(self) -> str:
        """What was sampled, of how much, and how it was extrapolated."""
        if self.whole:
            return f"all {self.dataset_bytes / MB:.4g} MB in {self.dataset_files} object(s)"
        piece = "range" if self.range_bytes else "object"
        overhead = (f"{self.overhead_s * 1000:.3g} ms per {piece}" if self.overhead_s else
                    f"no per-{piece} overhead separable from its sizes: scaled by bytes")
        share = f"{self.sample_bytes / self.dataset_bytes:.1%}"
        size = (f"{self.dataset_bytes / 1e9:.3g} GB" if self.dataset_bytes >= 1e9
                else f"{self.dataset_bytes / MB:.4g} MB")
        what = (f"{self.sample_files} ranges of {self.range_bytes / MB:.4g} MB spread over the "
                f"one object's {size} ({self.sample_bytes / MB:.4g} MB, "
                f"{share})" if self.range_bytes else
                f"a sample of {self.sample_bytes / MB:.4g} MB in {self.sample_files} of "
                f"{self.dataset_files} objects ({share} of {self.dataset_bytes / MB:.4g} MB)")
        return (f"{what}, extrapolated (rate moved {self.settle:.0%} over the sample's second "
                f"half; {overhead})")
