"""`diag storage`: the object-store experiment's config (diag.storage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from diag.config.base import Verify
from diag.config.source import BUCKET, SourceConfig


@dataclass
class StorageConfig(SourceConfig):
    """`diag storage`: object-store pull vs local disk read, the re-pull tax, land() miss/hit."""

    SOURCE: ClassVar[tuple[str, ...]] = BUCKET  # no model, no record fields

    local_dir: str = ""  # where data lands (the NVMe / persistent volume); "" = DIAG_HOME/storage
    size_mb: float = 200.0  # embedded dataset size; larger gives steadier rates and takes longer
    shards: int = 1  # embedded dataset as this many objects under a prefix (1 = a single object)
    repeats: int = 3  # measured repeats per method; more gives steadier medians
    budget_s: float = 0.0  # seconds the pulls may take (each method's sample sized to fit);
                           # 0 = no limit
    sample_mb: float = 0.0  # at most this many MB of whole objects per pull; 0 = no cap
    land: bool = False  # also land() the whole dataset, miss then verified hit (writes it all);
                        # False: a hit is estimated from the sample's cold local read
    warmup: int = 1  # untimed first rounds (connections, server cache)
    verify: Verify = "sha256"  # land() hit check: "sha256" catches
                               # flipped bytes, "size" is near-free
    dataset_gb: float = 0.0  # dataset size for the tax; 0 = the measured size (e.g. 25 for yours)
    runs_per_week: float = 20.0  # training starts per week that re-pull the dataset
    usd_per_hour: float = 0.0  # instance price for the tax; 0 = unknown (no money figures)

    QUICK: ClassVar[dict[str, Any]] = {"size_mb": 8.0, "repeats": 2}
    # `diag run`: 8 parts of boto3's default multipart size separate the methods
    RUN: ClassVar[dict[str, Any]] = {"size_mb": 64.0}

    def validate(self) -> None:
        super().validate()
        self._positive("size_mb", "shards", "repeats")
        self._non_negative("warmup", "dataset_gb", "runs_per_week", "usd_per_hour", "budget_s",
                           "sample_mb")
