"""Keep secrets out of everything a user sees: `redact(text)` puts `***` for every known secret
(environment, `register()`, HF token files, boto3's credentials) and anything shaped like one.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any

_SECRET_NAME = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|SESSION)", re.I)
_registered: set[str] = set()
_MIN_LEN = 6  # shorter values ("1", "true") would mangle the text
# credential shapes, wherever they came from: each keeps its label, loses its value
_SHAPES = re.compile(
    r"(?P<hf>(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,})"
    r"|(?P<aws>(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9]))"
    r"|(?P<amz>X-Amz-(?:Signature|Credential|Security-Token)=)[^&\s\"'<>]+"
    r"|(?P<url>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@\"'<>]+@"
)
_cache: dict[tuple[Any, ...], tuple[frozenset[str], Any]] = {}


def register(*values: str | None) -> None:
    """Mark values as secret even when no environment variable holds them."""
    _registered.update(v for v in values if v and len(v) >= _MIN_LEN)


def _read_hf_tokens(path: str) -> set[str]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return set()
    if os.path.basename(path) == "stored_tokens":  # INI: [name] hf_token = ...
        return {line.split("=", 1)[1].strip() for line in text.splitlines()
                if line.split("=", 1)[0].strip() == "hf_token" and "=" in line}
    return {text.strip()}


_aws_clients: str | None = None  # None: no S3 client yet; "given" keys (or unsigned); "chain"


def aws_client_made(given: bool) -> None:
    """Note how an S3 client got its credentials (given keys: redact() walks no chain)."""
    global _aws_clients
    _aws_clients = "chain" if not given or _aws_clients == "chain" else "given"


def _aws_credentials() -> Any:
    """botocore's resolved credentials, or None: only where a boto3 client walked the chain."""
    if "boto3" not in sys.modules or _aws_clients == "given":
        return None
    import botocore.session

    try:
        session = botocore.session.Session()
        disabled = os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower()
        if disabled in ("1", "true", "yes", "on"):
            session.get_component("credential_provider").remove("iam-role")
        return session.get_credentials()
    except Exception:  # a broken profile is reported where it is used
        return None


def _resolved() -> set[str]:
    """Secrets from the HF token files and boto3, resolved once per state of their inputs."""
    # the HF token files: HF_TOKEN_PATH, else <HF_HOME>/token, and stored_tokens beside each
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    paths = {os.path.expanduser(os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token"))}
    hub = sys.modules.get("huggingface_hub.constants")  # if imported: its answer too
    if hub is not None:
        paths.add(hub.HF_TOKEN_PATH)
    stamps = []
    for path in sorted(paths | {os.path.join(os.path.dirname(p), "stored_tokens") for p in paths}):
        try:
            st = os.stat(path)
            stamps.append((path, st.st_mtime_ns, st.st_size))
        except OSError:
            stamps.append((path, None, None))
    aws_env = tuple(os.environ.get(k) for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                                                 "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                                                 "AWS_EC2_METADATA_DISABLED"))
    key = (tuple(stamps), aws_env, "boto3" in sys.modules, _aws_clients)
    if key not in _cache:
        tokens = set().union(*(_read_hf_tokens(p) for p, mtime, _ in stamps if mtime is not None))
        _cache[key] = (frozenset(tokens), _aws_credentials())
    tokens, creds = _cache[key]
    values = set(tokens)
    if creds is not None:
        with contextlib.suppress(Exception):  # a failed renewal is the caller's error to report
            frozen = creds.get_frozen_credentials()  # cheap unless a role renews
            values |= {frozen.access_key or "", frozen.secret_key or "", frozen.token or ""}
    return {v for v in values if len(v) >= _MIN_LEN}


def secret_values() -> list[str]:
    """Every known secret value, longest first (so one containing another is replaced whole)."""
    found = {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= _MIN_LEN}
    return sorted(found | _registered | _resolved(), key=len, reverse=True)


def _shape(match: re.Match[str]) -> str:
    prefix = match.group("amz") or match.group("url")
    return (prefix + "***@" if match.group("url") else prefix + "***") if prefix else "***"


def redact(text: str, values: list[str] | None = None) -> str:
    """text with every known secret value, and anything shaped like a credential, as ***."""
    for value in secret_values() if values is None else values:
        text = text.replace(value, "***")
    return _SHAPES.sub(_shape, text)


def redact_frame(frame):  # pandas.DataFrame -> pandas.DataFrame
    """A copy of frame with every text cell redacted (what a CSV or a table may show)."""
    from pandas.api.types import is_object_dtype, is_string_dtype

    out, values = frame.copy(), secret_values()
    for column in out.columns:
        if is_object_dtype(out[column]) or is_string_dtype(out[column]):
            out[column] = out[column].map(lambda v: redact(v, values) if isinstance(v, str) else v)
    return out
