"""The data layer under the experiments: the user's record files as diag's records.

`read_source(path, fields, on_error)` reads one JSONL or Parquet file, or every such shard in a
folder (a landed s3 prefix), and maps each record to what the text pipeline tokenizes: Alpaca
instruction/input/output (the default), a prompt/response pair, or one text field.
"""

from diag.data.records import DATA_SUFFIXES, read_source, render_chat, shard_files

__all__ = ["DATA_SUFFIXES", "read_source", "render_chat", "shard_files"]
