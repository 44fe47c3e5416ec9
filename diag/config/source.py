"""Where a run's data and model come from: one set of fields, the same flags in every command.

A config names the groups it reads (`SOURCE`); its command offers only those and refuses a value
given to another. The checks here need no network (diag.preflight checks the rest).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from diag.config.base import ExperimentConfig

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # record files diag reads
MANIFEST_SUFFIX = ".diag-manifest.json"  # beside what diag.storage.land landed: ETags, CRCs
WEIGHT_FILES = ("*.safetensors", "*.bin")
# the source fields by what they name
BUCKET = ("source", "endpoint_url", "profile", "region", "sign_request", "retries")
RECORDS = ("text_field", "prompt_field", "response_field", "messages_field")
MODEL = ("model", "revision", "cache_dir", "repair_cache")


@dataclass
class RecordFields(ExperimentConfig):
    """Which fields of the user's records hold the text, for every command that reads records."""

    text_field: str = ""  # the records' field holding the whole text (loss on all of it);
                          # "" = prompt/response fields, or instruction/input/output
    prompt_field: str = ""  # the records' prompt field (with --response-field; loss on the
                            # response only); "" = instruction/input/output (Alpaca)
    response_field: str = ""  # the records' response field (with --prompt-field)
    messages_field: str = ""  # the records' chat field (a list of {role, content}, the last the
                              # assistant's), in the model's chat template; loss on the last

    def validate(self) -> None:
        super().validate()
        if bool(self.prompt_field) != bool(self.response_field) or sum(
                map(bool, (self.text_field, self.prompt_field, self.messages_field))) > 1:
            raise ValueError(f"{type(self).__name__}: give --text-field alone, --messages-field "
                             f"alone, or --prompt-field with --response-field (got text_field="
                             f"{self.text_field!r}, prompt_field={self.prompt_field!r}, "
                             f"response_field={self.response_field!r}, "
                             f"messages_field={self.messages_field!r})")

    def fields(self) -> dict[str, str]:
        """The record fields to read (diag.data.records.normalise's); {} = Alpaca."""
        return {k: v for k, v in (("text", self.text_field), ("prompt", self.prompt_field),
                                  ("response", self.response_field),
                                  ("messages", self.messages_field)) if v}

    def record_fields(self) -> dict[str, str]:
        """These four flags' values, to hand the same records to another config."""
        return {name: getattr(self, name) for name in RECORDS}


@dataclass
class SourceConfig(RecordFields):
    """The user's bucket and model, or (all empty) the embedded S3 server and hub."""

    source: str = ""  # your data: s3://bucket/key.{jsonl,parquet} or s3://bucket/prefix/ of
                      # shards; "" = the embedded S3 server and data
    endpoint_url: str = ""  # S3 endpoint of --source (MinIO, R2, GCS); "" = your AWS config
    profile: str = ""  # AWS profile for --source; "" = AWS_PROFILE or the default chain
    region: str = ""  # region for --source; "" = your AWS config (AWS_REGION, profile)
    sign_request: bool = True  # False (--no-sign-request) reads a public bucket with no credentials
    retries: int | None = None  # request retries and re-GETs of a dropped part; None = your
                                # AWS config (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE), 0 fails fast
    model: str = ""  # your model: "org/name" on HF_ENDPOINT or the hub, or a local folder with
                     # weights; "" = the embedded tiny Llama
    revision: str = "main"  # branch, tag or commit of a hub --model
    cache_dir: str = ""  # HF hub cache for --model; "" = your HF_HUB_CACHE (read only) for a
                         # hub id, <DIAG_HOME>/hf-cache for the embedded model
    repair_cache: bool = False  # True re-downloads cached files that fail their checksum (may
                                # write to your HF cache); False stops and reports them

    SOURCE: ClassVar[tuple[str, ...]] = BUCKET + RECORDS + MODEL  # the fields this config reads

    def validate(self) -> None:
        self.validate_source()  # first: a field this config does not read is refused as such
        super().validate()

    @classmethod
    def used_fields(cls) -> list[str]:
        """Its own fields and the source fields it reads (SOURCE)."""
        source = set(BUCKET + RECORDS + MODEL) - set(cls.SOURCE)
        return [name for name in super().used_fields() if name not in source]

    def validate_source(self) -> None:
        from urllib.parse import urlsplit

        from diag.secrets import redact, register

        name = type(self).__name__
        for f in dataclasses.fields(SourceConfig):  # what it would silently ignore
            self._check((f.name,), lambda v, f=f: f.name in self.SOURCE or v == f.default,
                        f"not read here; {name} reads " + ", ".join(self.SOURCE))
        try:  # a password in the URL is redacted from here on
            url = urlsplit(self.endpoint_url)
            register(url.password)
        except ValueError:  # a malformed URL: refused below
            url = urlsplit("")
        if self.endpoint_url and not (url.scheme in ("http", "https") and url.hostname):
            raise ValueError(redact(f"--endpoint-url={self.endpoint_url!r}: not a URL; expected "
                                    "http(s)://host[:port] of an S3-compatible store"))
        if self.retries is not None:
            self._non_negative("retries")
        self._check(("source",), lambda v: not v or v.startswith("s3://") and v[5:].split("/")[0],
                    "expected s3://bucket/key, s3://bucket/prefix/ or '' for the embedded server")
        # without a source these would not reach the embedded server: refuse, never measure
        # something else and exit 0
        stray = [f"--{f.replace('_', '-')}" for f in ("endpoint_url", "profile", "region")
                 if getattr(self, f)] + ([] if self.sign_request else ["--no-sign-request"])
        if stray and not self.source:
            raise ValueError(f"{name}.source is empty but {stray[0]} is given: the run "
                             f"would use the embedded server and ignore {stray[0]}; name your "
                             f"object with --source s3://bucket/key (or drop {stray[0]})")
        self._check(("revision",), bool, "name a branch, tag or commit (main)")
        check_model(self.model, name)

    def source_kwargs(self, into: type[SourceConfig] | None = None) -> dict[str, object]:
        """The source fields' values, to hand the same source to another experiment's config:
        those `into` reads (its SOURCE), or every one."""
        return {name: getattr(self, name) for name in (into or SourceConfig).SOURCE}


def check_model(model: str, owner: str = "SourceConfig") -> None:
    """'' (embedded), a local folder with a config and weights, or a hub id org/name."""
    if not model:
        return
    path = Path(model).expanduser()
    try:
        if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
            _check_folder(model, path, owner)
            return
    except PermissionError as err:
        raise ValueError(f"{owner}.model={model!r} (--model): cannot be read ({err.strerror}: "
                         f"{err.filename}); give diag read access to it, or name another "
                         "folder") from None
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", model, re.ASCII) or ".." in model:
        raise ValueError(f"{owner}.model={model!r} (--model): expected a hub id org/name "
                         "(letters, digits, - _ .), a local folder with weights, or '' for the "
                         "embedded model")


def _check_folder(model: str, path: Path, owner: str) -> None:
    if not path.exists():
        raise ValueError(f"{owner}.model={model!r} (--model): no such folder, and not a hub "
                         "id ('org/name'); allowed: '' (embedded model), a hub id, a folder "
                         "with config.json and weights")
    if not path.is_dir() or not (path / "config.json").is_file() or not any(
            next(path.glob(p), None) for p in WEIGHT_FILES):
        raise ValueError(f"{owner}.model={model!r} (--model): a local model must be a "
                         "folder with config.json and *.safetensors or *.bin weights; or "
                         "name a hub id org/name")


def check_out(out: str, flag: str = "--out") -> None:
    """A run folder must be new or empty: diag never mixes its files into an older run's."""
    if not out:
        return
    path = Path(out).expanduser()
    try:
        full = path.is_dir() and any(path.iterdir())
    except PermissionError as err:
        raise ValueError(f"{flag}={out!r}: cannot be read ({err.strerror}); name a new or empty "
                         "folder you can write") from None
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}={out!r}: is a file; name a new or empty folder")
    if full:
        raise ValueError(f"{flag}={out!r}: the folder is not empty; name a new or empty folder "
                         "(diag does not mix its files into another run's)")
