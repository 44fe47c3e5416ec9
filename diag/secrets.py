"""Keep secrets out of everything a user sees: errors, tables, reports, notebooks.

`redact(text)` replaces the value of every secret-looking environment variable (keys, tokens,
passwords) and every value registered with `register()` by `***`. Reports and the CLI pass their
text through it, so a credential in an endpoint URL or an exception message never leaks.
"""

from __future__ import annotations

import os
import re

_SECRET_NAME = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|SESSION)", re.I)
_registered: set[str] = set()
# Minimum length of a value worth redacting: shorter ones ("1", "true") would mangle text.
_MIN_LEN = 6


def register(*values: str | None) -> None:
    """Mark values as secret even when no environment variable holds them."""
    _registered.update(v for v in values if v and len(v) >= _MIN_LEN)


def secret_values() -> list[str]:
    found = {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= _MIN_LEN}
    # Longest first, so a secret that contains another is replaced whole.
    return sorted(found | _registered, key=len, reverse=True)


def redact(text: str) -> str:
    """text with every known secret value replaced by ***."""
    for value in secret_values():
        text = text.replace(value, "***")
    return text


def redact_frame(frame):  # pandas.DataFrame -> pandas.DataFrame
    """A copy of frame with every text cell redacted (what a CSV or a table may show)."""
    from pandas.api.types import is_object_dtype, is_string_dtype

    if not secret_values():
        return frame
    out = frame.copy()
    for column in out.columns:
        if is_object_dtype(out[column]) or is_string_dtype(out[column]):
            out[column] = out[column].map(lambda v: redact(v) if isinstance(v, str) else v)
    return out
