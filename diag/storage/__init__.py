"""Object store (S3) vs local disk: what re-pulling a dataset on every start costs, and the fix.

`run_storage(cfg)` measures pulls (boto3 defaults, boto3 tuned, s5cmd), `land()` miss then hit,
and local reads with a cold and a warm page cache, then prices the re-pull (`tax`) and gives the
`advice`. `land(url, dir)` lands a dataset on local disk once, verified, and reuses it.
"""

from diag.storage.experiment import PULLS, StorageResult, decide, measure, run_storage
from diag.storage.methods import pull, read_local
from diag.storage.landing import LandedDataset, land, local_paths
from diag.storage.objectstore import (list_remote, make_client, parse_url, source_client,
                                      transfer_plan, usable_cores)
from diag.storage.tax import advice, medians, storage_tax

__all__ = ["LandedDataset", "PULLS", "StorageResult", "advice", "decide", "land",
           "list_remote", "local_paths", "make_client", "measure", "medians", "parse_url",
           "pull", "read_local", "run_storage", "source_client", "storage_tax", "transfer_plan",
           "usable_cores"]
