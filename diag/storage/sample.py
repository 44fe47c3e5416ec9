"""A sample of a dataset's objects that represents its sizes, and the whole pull extrapolated.

`spread(objects)` orders the objects so that every prefix spans their size distribution (sorted
by size, visited median first, then the quartiles, the octiles, ...). `probe` pulls them one
after another until its time is spent: one row per object (the `storage_sample` frame), whose
cumulative rate shows whether the rate settled as the sample grew. `Extrapolation` fits each
object's seconds as a per-object overhead plus bytes over a rate (least squares) and gives the
factor that turns a pull of the sample into a pull of every object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diag.storage.objectstore import MB, RemoteObject

if TYPE_CHECKING:
    import pandas as pd


def spread(objects: list[RemoteObject]) -> list[RemoteObject]:
    """Every object once, in an order whose every prefix is spread over the sizes: positions
    1/2, 1/4, 3/4, 1/8, 3/8, ... of the objects sorted by size (a sample of the first k is a
    stratified sample, not the k smallest or the first k keys)."""
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


def probe(ordered: list[RemoteObject], pull_one: Callable[[RemoteObject, int], None],
          seconds: float, cap_bytes: int) -> pd.DataFrame:
    """Pull objects in `ordered` one at a time until `seconds` are spent (0: no limit) or the
    next would pass cap_bytes (0: no cap; the first object is always pulled); pull_one(object,
    bytes pulled before it). One row per object: key, bytes, seconds, the cumulative MB/s."""
    import pandas as pd

    rows, total, spent = [], 0, 0.0
    for obj in ordered:
        full = cap_bytes and total + obj.size > cap_bytes
        if rows and ((seconds and spent >= seconds) or full):
            break
        start = time.perf_counter()
        pull_one(obj, total)
        took = time.perf_counter() - start
        total, spent = total + obj.size, spent + took
        rows.append({"key": obj.key, "bytes": obj.size, "seconds": took, "sample_bytes": total,
                     "sample_seconds": spent, "sample_mb_per_s": total / MB / spent
                     if spent > 0 else float("nan")})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Extrapolation:
    """A sample's pull turned into the whole dataset's: seconds = objects x overhead_s + bytes /
    rate, fitted on the probe's objects (one after another, so each object's time is its own)."""

    sample_bytes: int
    sample_files: int
    dataset_bytes: int
    dataset_files: int
    overhead_s: float  # per object (requests, connection): what a larger object does not dilute
    bytes_per_s: float  # the rate once an object streams
    settle: float  # how far the cumulative rate moved over the sample's second half (0.03: 3%)

    @classmethod
    def fit(cls, sample: pd.DataFrame, dataset_bytes: int, dataset_files: int) -> Extrapolation:
        import numpy as np

        size, secs = sample["bytes"].to_numpy(float), sample["seconds"].to_numpy(float)
        overhead, rate = 0.0, size.sum() / max(secs.sum(), 1e-9)
        if len(set(size)) > 1:  # two sizes or more: the intercept is the per-object overhead
            slope, intercept = np.polyfit(size, secs, 1)
            if slope > 0 and intercept >= 0:
                overhead, rate = float(intercept), 1 / float(slope)
        cum = sample["sample_mb_per_s"].to_numpy(float)
        half = int(np.searchsorted(sample["sample_bytes"].to_numpy(), size.sum() / 2))
        settle = abs(cum[-1] - cum[min(half, len(cum) - 1)]) / cum[-1] if cum[-1] > 0 else 0.0
        return cls(int(size.sum()), len(sample), dataset_bytes, dataset_files, overhead, rate,
                   float(settle))

    @property
    def factor(self) -> float:
        """The whole pull's seconds over the sample's, by the fitted model (1: the whole set)."""
        if self.sample_bytes >= self.dataset_bytes:
            return 1.0
        whole = self.dataset_files * self.overhead_s + self.dataset_bytes / self.bytes_per_s
        part = self.sample_files * self.overhead_s + self.sample_bytes / self.bytes_per_s
        return whole / part

    def label(self) -> str:
        """What was sampled, of how much: "64 MB in 4 of 64 objects (6%), extrapolated"."""
        if self.sample_bytes >= self.dataset_bytes:
            return f"all {self.dataset_bytes / MB:.4g} MB in {self.dataset_files} object(s)"
        overhead = (f"{self.overhead_s * 1000:.3g} ms per object" if self.overhead_s else
                    "no per-object overhead separable from its sizes: scaled by bytes")
        return (f"a sample of {self.sample_bytes / MB:.4g} MB in {self.sample_files} of "
                f"{self.dataset_files} objects ({self.sample_bytes / self.dataset_bytes:.1%} of "
                f"{self.dataset_bytes / MB:.4g} MB), extrapolated (rate moved "
                f"{self.settle:.0%} over the sample's second half; {overhead})")
