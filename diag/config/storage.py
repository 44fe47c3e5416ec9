"""`diag storage`: the object-store experiment's config (diag.storage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from diag.config.base import ExperimentConfig, Verify, VERIFY_MODES


@dataclass
class StorageConfig(ExperimentConfig):
    """`diag storage`: object-store pull vs local disk read, the re-pull tax, land() miss/hit."""

    source: str = ""  # s3://bucket/key or s3://bucket/prefix/; "" = embedded S3 server + synthetic data
    endpoint_url: str = ""  # S3 endpoint of --source; "" = your AWS config (AWS_ENDPOINT_URL, profile)
    profile: str = ""  # AWS profile for --source; "" = AWS_PROFILE or the default profile
    region: str = ""  # region for --source; "" = your AWS config (AWS_REGION, profile)
    sign_request: bool = True  # False (--no-sign-request) reads a public bucket with no credentials
    local_dir: str = ""  # where data lands (the NVMe / persistent volume); "" = DIAG_HOME/storage
    size_mb: float = 200.0  # embedded dataset size; larger gives steadier rates and takes longer
    shards: int = 1  # embedded dataset as this many objects under a prefix (1 = a single object)
    repeats: int = 3  # measured repeats per method; more gives steadier medians
    warmup: int = 1  # untimed first rounds (connections, server cache): not reported
    verify: Verify = "sha256"  # land() hit check: "sha256" catches flipped bytes, "size" is near-free
    retries: int | None = None  # request retries and re-GETs of a dropped part; None = your AWS config (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE), 0 fails fast
    dataset_gb: float = 0.0  # dataset size for the tax; 0 = the measured size (e.g. 25 for yours)
    runs_per_week: float = 20.0  # training starts per week that re-pull the dataset
    usd_per_hour: float = 0.0  # instance price for the tax; 0 = unknown (no money figures)

    QUICK: ClassVar[dict[str, Any]] = {"size_mb": 8.0, "repeats": 2}

    def validate(self) -> None:
        from diag.secrets import register
        from urllib.parse import urlsplit

        try:  # a password in the URL is redacted everywhere from here on
            register(urlsplit(self.endpoint_url).password)
        except ValueError:  # a malformed URL: botocore refuses it with its own message
            pass
        self._positive("size_mb", "shards", "repeats")
        self._non_negative("warmup", "dataset_gb", "runs_per_week", "usd_per_hour")
        if self.retries is not None:
            self._non_negative("retries")
        self._choice("verify", VERIFY_MODES)
        if self.source and not (self.source.startswith("s3://") and self.source[5:].split("/")[0]):
            raise ValueError(f"StorageConfig.source={self.source!r}: expected s3://bucket/key, "
                             "s3://bucket/prefix/ or '' for the embedded server")
        # Without a source the run uses the embedded server, which these would not reach: refuse
        # rather than measure something else and exit 0 (diag never uploads into a user's store)
        stray = [f"--{f.replace('_', '-')}" for f in ("endpoint_url", "profile", "region")
                 if getattr(self, f)] + ([] if self.sign_request else ["--no-sign-request"])
        if stray and not self.source:
            raise ValueError(f"StorageConfig.source is empty but {stray[0]} is given: the run "
                             f"would use the embedded server and ignore {stray[0]}; name your "
                             f"object with --source s3://bucket/key (or drop {stray[0]})")
