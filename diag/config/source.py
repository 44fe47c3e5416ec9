"""Where a run's data and model come from: the same flags in every command, the source parsed once
(`cfg.url`: an S3Url, HubUrl or LocalUrl), and the experiments that read only that (`diag storage`:
the bucket; `diag model-load`: the model). A config names the groups it reads (`SOURCE`) and
refuses a value given to another; no check here needs a network."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from diag.config.base import (MODEL_LOAD_SCENARIOS, ExperimentConfig, LoadProcess, Scenario,
                              Verify, parse_list)

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # record files diag reads
COMPRESSED = (".gz", ".zst")  # a JSONL file may be compressed (pyarrow's codecs read it)
STALL_S = 20.0  # seconds without a byte that make an S3 read stalled (--stall-s's default)
MANIFEST_SUFFIX = ".diag-manifest.json"  # beside what diag.storage.land landed: ETags, CRCs
WEIGHT_FILES = ("*.safetensors", "*.bin")
# the source fields by what they name
BUCKET = ("source", "endpoint_url", "profile", "region", "sign_request", "retries", "stall_s")
RECORDS = ("text_field", "prompt_field", "response_field", "messages_field")
MODEL = ("model", "revision", "cache_dir", "repair_cache")


@dataclass
class RecordFields(ExperimentConfig):
    """Which fields of the user's records hold the text, for every command that reads records."""

    text_field: str = ""  # the records' field holding the whole text (loss on all of it)
    prompt_field: str = ""  # the records' prompt field (with --response-field): loss on the answer
    response_field: str = ""  # the records' response field (with --prompt-field)
    messages_field: str = ""  # the records' chat field ([{role, content}]): loss on the last turn

    SOURCE: ClassVar[tuple[str, ...]] = RECORDS  # the source fields this config reads

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
        """The record fields to read (diag.data.records.normalise's); {} = Alpaca's."""
        return {k.removesuffix("_field"): getattr(self, k) for k in RECORDS if getattr(self, k)}

    def source_kwargs(self, into: type[RecordFields] | None = None) -> dict[str, object]:
        """The source fields' values that `into` reads (its SOURCE; None: this config's)."""
        return {name: getattr(self, name) for name in (into or type(self)).SOURCE}


@dataclass
class SourceConfig(RecordFields):
    """The user's bucket and model, or (all empty) the embedded S3 server and hub."""

    source: str = ""  # your data (s3://, hf://datasets/, a local path); "" = the embedded S3 server
    endpoint_url: str = ""  # S3 endpoint of --source (MinIO, R2, GCS); "" = your AWS config
    profile: str = ""  # AWS profile for --source; "" = AWS_PROFILE or the default chain
    region: str = ""  # region for --source; "" = your AWS config (AWS_REGION, profile)
    sign_request: bool = True  # False (--no-sign-request) reads a public bucket with no credentials
    retries: int | None = None  # request retries and re-GETs of a part; None = your AWS config
    stall_s: float = STALL_S  # an S3 read with no byte for this long has stalled (its timeout)
    model: str = ""  # your model: a hub "org/name" or a local folder; "" = the embedded tiny Llama
    revision: str = "main"  # branch, tag or commit of a hub --model
    cache_dir: str = ""  # HF hub cache for --model; "" = your HF_HUB_CACHE (read only)
    repair_cache: bool = False  # re-download cached files failing their checksum; False: report

    SOURCE: ClassVar[tuple[str, ...]] = BUCKET + RECORDS + MODEL

    def validate(self) -> None:
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
        self._positive("stall_s")
        # parsed once: every reader of the source takes cfg.url
        self.url: S3Url | HubUrl | LocalUrl | None = parse_url(self.source, f"{name}.source")
        # these reach an S3 store only: with another source they would be silently ignored
        stray = [f"--{f.replace('_', '-')}" for f in ("endpoint_url", "profile", "region")
                 if getattr(self, f)] + ([] if self.sign_request else ["--no-sign-request"])
        if stray and not isinstance(self.url, S3Url):
            where = ("the run would use the embedded server" if not self.source else
                     f"--source={self.source!r} is no s3:// URL")
            raise ValueError(f"{name}.source is {repr(self.source) if self.source else 'empty'} "
                             f"but {stray[0]} is given: {where} and ignore {stray[0]}; name your "
                             f"object with --source s3://bucket/key (or drop {stray[0]})")
        self._check(("revision",), bool, "name a branch, tag or commit (main)")
        check_model(self.model, name)
        super().validate()  # the record fields last: a field not read here is refused as such


def data_file(name: str) -> bool:
    """A record file diag reads: *.jsonl, *.json, *.parquet, a JSONL or JSON one compressed."""
    stem, dot, last = name.rpartition(".")
    if f".{last}" in COMPRESSED and dot:
        return f".{stem.rpartition('.')[2]}" in (".jsonl", ".json")
    return f".{last}" in DATA_SUFFIXES and not name.endswith(MANIFEST_SUFFIX)


def record_files(found: list[Any], where: object, name: Callable[[Any], str]) -> list[Any]:
    """The record files among found (in its order), each named by name(); ValueError: none."""
    if usable := [f for f in found if data_file(name(f))]:
        return usable
    raise ValueError(f"--source: no readable shard under {where} (found "
                     f"{', '.join(Path(name(f)).name for f in found[:3]) or 'no files'}); "
                     "allowed: " + ", ".join(f"*{s}" for s in DATA_SUFFIXES) + " (JSONL also "
                     + ", ".join(COMPRESSED) + ")")


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str  # "" or ending in "/" = a prefix (many objects), else one object

    @property
    def is_prefix(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class HubUrl:
    repo_id: str
    revision: str
    path: str  # one data file, or a folder ("": the repo) of them

    @property
    def is_prefix(self) -> bool:
        return not data_file(self.path)

    def __str__(self) -> str:
        at = "" if self.revision == "main" else f"@{self.revision}"
        return f"hf://datasets/{self.repo_id}{at}/{self.path}"


@dataclass(frozen=True)
class LocalUrl:
    path: Path

    @property
    def is_prefix(self) -> bool:
        return self.path.is_dir()

    def __str__(self) -> str:
        return str(self.path)


def parse_url(source: str, flag: str = "source") -> S3Url | HubUrl | LocalUrl | None:
    """The source's kind and parts (None: '', the embedded server); else ValueError naming flag."""
    allowed = ("expected s3://bucket/key or s3://bucket/prefix/, hf://datasets/org/name[@rev]"
               "/path, a local file or folder of shards, or '' for the embedded server")
    if not source:
        return None
    if source.startswith("s3://"):
        return parse_s3(source, flag, f"no bucket; {allowed}")
    if source.startswith("hf://"):
        repo = source[5:].split("/")
        if len(repo) < 3 or repo[0] != "datasets" or not repo[1] or not repo[2].split("@")[0]:
            raise ValueError(f"{flag}={source!r}: a hub source is hf://datasets/org/name"
                             "[@revision]/path (a dataset repo); " + allowed)
        name, _, revision = repo[2].partition("@")
        return HubUrl(f"{repo[1]}/{name}", revision or "main", "/".join(repo[3:]))
    if "://" in source or not Path(source).expanduser().exists():
        raise ValueError(f"{flag}={source!r}: no such file or folder; {allowed}")
    return LocalUrl(Path(source).expanduser().resolve())


def parse_s3(url: str, flag: str = "source", why: str = "") -> S3Url:
    bucket, _, key = url[5:].partition("/") if str(url).startswith("s3://") else ("", "", "")
    if not bucket:
        raise ValueError(f"{flag}={url!r}: " + (why or "expected s3://bucket/key (one object) "
                                                "or s3://bucket/prefix/ (every object under it)"))
    return S3Url(bucket, key)


def check_model(model: str, owner: str = "SourceConfig") -> None:
    """'' (embedded), a local folder with a config and weights, or a hub id org/name."""
    path, what = Path(model).expanduser(), f"{owner}.model={model!r} (--model)"
    try:
        local = bool(model) and (path.exists() or model.startswith((".", "/", "~"))
                                 or model.count("/") > 1)
        weights = local and path.is_dir() and (path / "config.json").is_file() and any(
            next(path.glob(p), None) for p in WEIGHT_FILES)
    except PermissionError as err:
        raise ValueError(f"{what}: cannot be read ({err.strerror}: {err.filename}); give diag "
                         "read access to it, or name another folder") from None
    if local and not path.exists():
        raise ValueError(f"{what}: no such folder, and not a hub id ('org/name'); allowed: '' "
                         "(embedded model), a hub id, a folder with config.json and weights")
    if local and not weights:
        raise ValueError(f"{what}: a local model must be a folder with config.json and "
                         "*.safetensors or *.bin weights; or name a hub id org/name")
    if model and not local and (not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", model, re.ASCII)
                                or ".." in model):
        raise ValueError(f"{what}: expected a hub id org/name (letters, digits, - _ .), a local "
                         "folder with weights, or '' for the embedded model")


def check_out(out: str, flag: str = "--out") -> None:
    """A run folder must be new or empty: diag never mixes its files into an older run's."""
    if not out:
        return
    try:
        full = (path := Path(out).expanduser()).is_dir() and any(path.iterdir())
    except PermissionError as err:
        raise ValueError(f"{flag}={out!r}: cannot be read ({err.strerror}); name a new or empty "
                         "folder you can write") from None
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag}={out!r}: is a file; name a new or empty folder")
    if full:
        raise ValueError(f"{flag}={out!r}: the folder is not empty; name a new or empty folder "
                         "(diag does not mix its files into another run's)")


@dataclass
class StorageConfig(SourceConfig):
    """`diag storage`: object-store pull vs local disk read, the re-pull tax, land() miss/hit."""

    SOURCE: ClassVar[tuple[str, ...]] = BUCKET  # no model, no record fields

    local_dir: str = ""  # where data lands (the NVMe / persistent volume); "" = DIAG_HOME/storage
    size_mb: float = 200.0  # embedded dataset size; larger gives steadier rates and takes longer
    shards: int = 1  # embedded dataset as this many objects under a prefix (1 = a single object)
    repeats: int = 3  # measured repeats per method; more gives steadier medians
    budget_s: float = 0.0  # seconds the pulls may take (each method's sample fits); 0 = no limit
    sample_mb: float = 0.0  # at most this many MB of whole objects per pull; 0 = no cap
    land: bool = False  # also land() the whole dataset, miss then hit; False: a hit is estimated
    warmup: int = 0  # untimed first rounds (the probe's pull already warms the connections)
    verify: Verify = "sha256"  # land() hit check: "sha256" catches flipped bytes, "size" is free
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


@dataclass
class ModelLoadConfig(SourceConfig):
    """`diag model-load`: fresh vs cached model load, each part (download ... tokenizer) timed."""

    SOURCE: ClassVar[tuple[str, ...]] = MODEL  # the model's flags; no bucket, no records

    scenarios: list[Scenario] = field(  # fewer run faster; fresh downloads the model every repeat
        default_factory=lambda: list(MODEL_LOAD_SCENARIOS))
    repeats: int = 1  # measured loads per scenario after the warm-up; 5+ lets model_cache resolve
    budget_s: float = 0.0  # > 0: more repeats while model_cache is unresolved and they fit
    estimate_fresh: bool = False  # a cached model's fresh load from one file's download rate
    warmup: int = 1  # untimed loads first (the page cache of the model and libraries)
    quantize: bool = True  # 4-bit nf4 as QLoRA loads its base; False keeps the checkpoint dtype
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:N"
    process: LoadProcess = "fork"  # "fork": imports paid once; "exec": a fresh interpreter a load
    trust_remote_code: bool = False  # True runs Python code from the model repo: only one you trust
    timeout_s: float = 1800.0  # per load process; a large model over a slow link needs more

    QUICK: ClassVar[dict[str, Any]] = {"repeats": 1}

    def validate(self) -> None:
        super().validate()  # the source flags
        self._positive("repeats", "timeout_s")
        self._non_negative("warmup", "budget_s")
        self.scenarios = parse_list(self.scenarios)
        self._check(("scenarios",), lambda v: v and len(set(v)) == len(v), "name each scenario "
                    "once: " + ", ".join(MODEL_LOAD_SCENARIOS))
        for s in self.scenarios:
            if s not in MODEL_LOAD_SCENARIOS:
                raise ValueError(f"ModelLoadConfig.scenarios: {s!r} is not a scenario; allowed "
                                 "values are " + ", ".join(map(repr, MODEL_LOAD_SCENARIOS)))
