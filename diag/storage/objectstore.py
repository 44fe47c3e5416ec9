"""The object-store client side: s3:// URLs, boto3 clients (the user's AWS configuration, always
timing out), listings, transfer plans, deadlines, and errors naming the URL, endpoint and fix.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from diag.config.source import STALL_S, HubUrl, S3Url
from diag.machine.device import usable_cores  # noqa: F401  transfer_plan's cores; re-exported
from diag.secrets import aws_client_made, redact, register

if TYPE_CHECKING:
    from diag.config import SourceConfig

MB = 1_000_000  # decimal megabytes, like network and disk rates
CONNECT_S = 5  # botocore's connect timeout on every client
SLACK = 4  # a pull may take this many times the seconds its bytes take at the rate measured
FLOOR_MB_S = 10.0  # the rate a deadline assumes before one is measured


@dataclass(frozen=True)
class RemoteObject:
    key: str
    size: int
    etag: str  # without quotes


@dataclass(frozen=True)
class TransferPlan:
    single_get_below: int  # objects smaller than this go in one GET
    part_bytes: int
    concurrency: int

    def transfer_config(self, retries: int | None = None) -> Any:
        """land()'s TransferConfig; "classic": the engine diag checks while it streams."""
        from boto3.s3.transfer import TransferConfig

        extra = {} if retries is None else {"num_download_attempts": retries + 1}
        return TransferConfig(preferred_transfer_client="classic",
                              multipart_threshold=self.single_get_below,
                              multipart_chunksize=self.part_bytes,
                              max_concurrency=self.concurrency, **extra)


def transfer_plan(size: int, cores: int | None = None) -> TransferPlan:
    """One GET under 32 MB, else ~2 parts per core (docs/calibration.md, storage, says why)."""
    cores = max(1, cores or usable_cores())
    part = min(256 * MB, max(8 * MB, -(-size // (2 * cores))))
    return TransferPlan(32 * MB, part, max(1, min(2 * cores, -(-size // part))))


def register_url_secret(url: str | None) -> None:
    """An endpoint URL may carry `user:password@`: its password is redacted wherever diag writes."""
    with contextlib.suppress(ValueError):  # a malformed URL: botocore refuses it itself
        register(urlsplit(url or "").password)


def make_client(endpoint_url: str = "", *, credentials: dict[str, str] | None = None,
                retries: int | None = None, max_pool: int = 10, profile: str = "",
                region: str = "", unsigned: bool = False, stall_s: float = STALL_S) -> Any:
    """A boto3 S3 client: the user's AWS configuration but for the arguments; it times out."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import InvalidRegionError, ProfileNotFound

    register_url_secret(endpoint_url)
    options: dict[str, Any] = {"max_pool_connections": max(10, max_pool),
                               "connect_timeout": CONNECT_S, "read_timeout": stall_s}
    if retries is not None:  # an explicit Config wins over AWS_MAX_ATTEMPTS and the profile
        options["retries"] = {"total_max_attempts": retries + 1, "mode": "standard"}
    if unsigned:
        options["signature_version"] = UNSIGNED
    kwargs = {**(credentials or {}), **({"endpoint_url": endpoint_url} if endpoint_url else {}),
              **({"region_name": region} if region else {})}
    try:
        session = boto3.Session(profile_name=profile or None)
    except ProfileNotFound as err:
        raise RuntimeError(f"{err}: check --profile / AWS_PROFILE against the [profile ...] "
                           "sections of ~/.aws/config") from None
    given = bool(credentials and credentials.get("aws_secret_access_key"))
    if given:
        register(*(credentials.get(k) for k in ("aws_access_key_id", "aws_secret_access_key",
                                                "aws_session_token")))
    aws_client_made(given or unsigned)  # given keys: redaction walks no chain (no IMDS)
    try:
        client = session.client("s3", config=Config(**options), **kwargs)
    except InvalidRegionError:
        where = f"--region={region!r}" if region else f"the region of your AWS config " \
            f"({session.region_name!r}: AWS_REGION, AWS_DEFAULT_REGION or the profile's)"
        raise ValueError(f"{where}: not a region name; allowed: letters, digits and '-' (as "
                         "us-east-1, or auto for R2)") from None
    register_url_secret(client.meta.endpoint_url)  # AWS_ENDPOINT_URL or the profile's
    return client


def source_client(cfg: SourceConfig, server: Any = None) -> Any:
    """cfg.source's client: boto3's (or `server`'s), HfApi for hf://, None for local files."""
    if server is None and isinstance(cfg.url, HubUrl):
        from huggingface_hub import HfApi

        return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    if server is None and not isinstance(cfg.url, S3Url):
        return None
    where = {"endpoint_url": cfg.endpoint_url, "profile": cfg.profile, "region": cfg.region,
             "unsigned": not cfg.sign_request} if server is None else {
        "endpoint_url": server.endpoint_url, "credentials": {
            "aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key,
            "region_name": server.region}}
    return make_client(**where, retries=cfg.retries, max_pool=2 * usable_cores(),
                       stall_s=cfg.stall_s)


def deadline_s(nbytes: int, mb_per_s: float | None, stall_s: float) -> float:
    """stall_s plus SLACK x nbytes' seconds at the measured rate (FLOOR_MB_S before one is)."""
    return stall_s + SLACK * nbytes / MB / (mb_per_s or FLOOR_MB_S)


@contextlib.contextmanager
def deadline(client: Any, seconds: float, what: str, url: object = None) -> Iterator[None]:
    """After `seconds`, refuse the client's requests and shut its sockets; errors in one line."""
    if not hasattr(client, "meta"):  # not boto3's (HfApi): its own timeouts apply
        yield
        return
    expired, endpoint = threading.Event(), client.meta.endpoint_url

    def refuse(**_: Any) -> None:
        if expired.is_set():  # not an OSError: s3transfer would retry that
            raise RuntimeError(f"{what}: the deadline passed")

    def expire() -> None:
        expired.set()
        _cut(endpoint)

    hook = f"diag-deadline-{id(expired)}"
    client.meta.events.register("before-send.s3", refuse, unique_id=hook)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception as err:
        if expired.is_set():
            raise failure(what, client, f"not done within its deadline of {seconds:.3g} s "
                          "(--stall-s plus 4x its bytes at the rate measured): the endpoint "
                          "stalled; check it, or raise --stall-s") from None
        if url is None or isinstance(err, (RuntimeError, ValueError)):
            raise
        raise remote_error(err, url, client) from None  # botocore's and s3transfer's
    finally:
        timer.cancel()
        client.meta.events.unregister("before-send.s3", unique_id=hook)


def _cut(endpoint: str) -> None:
    """Shut this process's sockets to endpoint (Linux; elsewhere the read timeout ends a read)."""
    url = urlsplit(endpoint)
    try:
        peers = {a[4][:2] for a in socket.getaddrinfo(
            url.hostname, url.port or (443 if url.scheme == "https" else 80))}
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket
            continue
        with contextlib.suppress(OSError):
            if sock.getpeername()[:2] in peers:
                sock.shutdown(socket.SHUT_RDWR)
        sock.detach()


def failure(url: object, client: Any, text: str) -> RuntimeError:
    """One line naming the URL and the client's endpoint (boto3's or HfApi's), then `text`."""
    endpoint = client.endpoint if hasattr(client, "endpoint") else client.meta.endpoint_url
    return RuntimeError(redact(f"{url} (endpoint {endpoint}): {text}"))


_CREDS = "(--profile / AWS_PROFILE, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, the instance role)"
_ANSWERS = {  # an S3 error code (or HTTP status): what it means and what fixes it
    "NoSuchBucket": "the bucket does not exist at this endpoint (check --source, and "
                    "--endpoint-url / --region if the bucket lives elsewhere)",
    **dict.fromkeys(("NoSuchKey", "404", "NotFound"), "no such object (check the key in "
                    "--source; a prefix ends with '/')"),
    **dict.fromkeys(("PermanentRedirect", "AuthorizationHeaderMalformed", "301"), "the bucket "
                    "is in another region ({code}): pass --region or set AWS_REGION to the "
                    "bucket's region"),
    **dict.fromkeys(("PreconditionFailed", "412"), "the object changed while it was landing; "
                    "run again"),
    **dict.fromkeys(("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                     "InvalidToken", "ExpiredToken", "Forbidden"), "access denied ({code})"),
}


def remote_error(err: Exception, url: str | S3Url, client: Any) -> RuntimeError:
    """One clear message naming the URL, the endpoint and what fixes it, never a credential."""
    from botocore import UNSIGNED
    from botocore.exceptions import (ClientError, EndpointConnectionError, NoCredentialsError,
                                     ProfileNotFound, ReadTimeoutError)

    if isinstance(err, ClientError):
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(err.response.get("Error", {}).get("Code", "")) or str(status)
        text = _ANSWERS.get("403" if status == 403 and code not in _ANSWERS else code,
                            "the server answered {code}").format(code=code)
        if text.startswith("access denied"):
            text += (" to an unsigned request (--no-sign-request): the bucket is not public; "
                     f"drop --no-sign-request and give credentials {_CREDS}"
                     if client.meta.config.signature_version is UNSIGNED else
                     f": check the credentials {_CREDS}; a public bucket needs --no-sign-request")
    elif isinstance(err, ReadTimeoutError):
        text = (f"no answer within --stall-s={client.meta.config.read_timeout:g} s (read "
                "timeout): the endpoint stalled; check it, or raise --stall-s")
    elif isinstance(err, EndpointConnectionError):
        text = ("cannot connect to the endpoint (refused or unreachable); check --endpoint-url / "
                "AWS_ENDPOINT_URL and that the server is up")
    elif isinstance(err, NoCredentialsError):
        text = ("no AWS credentials found: for a public bucket pass --no-sign-request; else set "
                "--profile / AWS_PROFILE or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run "
                "on an instance with a role")
    elif isinstance(err, ProfileNotFound):
        text = f"{err}: check --profile / AWS_PROFILE against ~/.aws/config"
    else:
        text = f"{type(err).__name__}: {err}"
    return failure(url, client, text)


def list_s3(client: Any, url: S3Url) -> list[RemoteObject]:
    """The object (HEAD) or every object under the prefix (LIST): no GET."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        if not url.is_prefix:
            try:
                head = client.head_object(Bucket=url.bucket, Key=url.key)
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    client.head_bucket(Bucket=url.bucket)  # a missing bucket: its own 404
                raise
            return [RemoteObject(url.key, int(head["ContentLength"]), head["ETag"].strip('"'))]
        found = [RemoteObject(o["Key"], int(o["Size"]), o["ETag"].strip('"'))
                 for page in client.get_paginator("list_objects_v2").paginate(
                     Bucket=url.bucket, Prefix=url.key) for o in page.get("Contents", [])
                 if not (o["Key"].endswith("/") and o["Size"] == 0)]  # not folder markers
    except (ClientError, BotoCoreError) as err:
        if isinstance(err, ClientError) and err.operation_name == "HeadBucket" and \
                err.response.get("Error", {}).get("Code") in ("404", "NotFound"):
            err.response["Error"]["Code"] = "NoSuchBucket"
        raise remote_error(err, url, client) from None
    if not found:
        raise failure(url, client, "no objects under this prefix (check --source; one object "
                      "has no trailing '/')")
    return found
