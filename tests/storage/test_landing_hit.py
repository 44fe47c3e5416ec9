"""diag.storage.landing's hit decision on local files: what makes a landed copy reusable.

`_local_ok` is the check land() runs on every landed file before it calls a listing a hit: the
size always, the sha256 unless verify="size". Plain files, no server: the decision alone.
"""

from __future__ import annotations

import hashlib
import re

import pytest

from diag.storage import landing


def _entry(data: bytes) -> dict[str, object]:
    return {"key": "k", "size": len(data), "etag": "e", "sha256": hashlib.sha256(data).hexdigest()}


def test_a_file_with_its_size_and_sha256_is_reused(tmp_path) -> None:
    path = tmp_path / "shard.bin"
    path.write_bytes(b"0123456789")
    entry = _entry(b"0123456789")
    assert landing._local_ok(path, entry, "sha256") is True
    assert landing._local_ok(path, entry, "size") is True


def test_a_flipped_byte_is_caught_by_sha256_only(tmp_path) -> None:
    path = tmp_path / "shard.bin"
    path.write_bytes(b"0123456789")
    entry = _entry(b"0123456780")  # same size, one byte differs
    assert landing._local_ok(path, entry, "sha256") is False
    assert landing._local_ok(path, entry, "size") is True  # the documented cost of "size"


@pytest.mark.parametrize("verify", ["sha256", "size"])
def test_a_truncated_grown_or_missing_file_is_never_reused(tmp_path, verify: str) -> None:
    entry = _entry(b"0123456789")
    path = tmp_path / "shard.bin"
    path.write_bytes(b"012345678")
    assert landing._local_ok(path, entry, verify) is False
    path.write_bytes(b"0123456789!")
    assert landing._local_ok(path, entry, verify) is False
    assert landing._local_ok(tmp_path / "gone.bin", entry, verify) is False


def test_an_empty_object_lands_and_is_reused(tmp_path) -> None:
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    assert landing._local_ok(path, _entry(b""), "sha256") is True


def test_an_unknown_verify_mode_is_refused_before_any_request(tmp_path) -> None:
    with pytest.raises(ValueError, match="^" + re.escape("verify='md5': allowed values are "
                                                         "'sha256', 'size'") + "$"):
        landing.land("s3://bucket/key", tmp_path, client=object(), verify="md5")
