"""Stand-ins on 127.0.0.1 that speak the real protocols, so the same client code runs here and on
a cloud box: an S3-compatible server (boto3 with an endpoint URL), a Hugging Face hub endpoint
(`HF_ENDPOINT`), a synthetic instruction dataset and a tiny Llama model, made once."""

from diag.embedded.hub import publish_model
from diag.embedded.servers import HubServer, LoopbackServer, S3Server
from diag.embedded.synth import (Assets, embedded_dataset, ensure_assets, synthetic_dataset,
                                 synthetic_records, tiny_model)

__all__ = ["Assets", "HubServer", "LoopbackServer", "S3Server", "embedded_dataset",
           "ensure_assets", "publish_model", "synthetic_dataset", "synthetic_records", "tiny_model"]
