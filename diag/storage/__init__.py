"""Object store or hub vs local disk: `run_storage(cfg)` prices re-pulling a dataset per start;
`land()` lands an S3 dataset once, verified; `fetch` gives a job its data from any source.
"""

from diag.storage.experiment import StorageResult, decide, run_storage
from diag.storage.landing import land
from diag.storage.sample import pull, read_local
from diag.storage.objectstore import make_client, source_client, transfer_plan
from diag.storage.sources import fetch, list_remote, parse_url  # parse_url: diag.config.source's
from diag.storage.tax import advice, medians, storage_tax

__all__ = ["StorageResult", "advice", "decide", "fetch", "land", "list_remote", "make_client",
           "medians", "parse_url", "pull", "read_local", "run_storage", "source_client",
           "storage_tax", "transfer_plan"]
