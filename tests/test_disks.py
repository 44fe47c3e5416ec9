"""diag.disks: the kind of the filesystem under a path, and the page cache (mincore, eviction)."""

from __future__ import annotations

import os

from diag import disks


def test_disk_kind(tmp_path: os.PathLike[str]) -> None:
    assert disks.disk_kind(tmp_path) in ("nvme", "network", "other")
    assert disks.disk_kind("/") in ("nvme", "network", "other")
    assert disks._kind("/dev/nvme0n1p1", "ext4", "rw") == "nvme"
    assert disks._kind("server:/export", "nfs4", "rw") == "network"
    assert disks._kind("bucket", "fuse.gcsfuse", "rw") == "network"
    assert disks._kind("mountpoint-s3", "fuse", "rw") == "network"
    assert disks._kind("overlay", "overlay", "rw,upperdir=/proc/x") == "other"


def test_disks_skip_pseudo_filesystems() -> None:
    kinds = disks.disks()
    assert all(d["fstype"] not in ("proc", "sysfs", "tmpfs", "cgroup") for d in kinds)
    assert all(d["kind"] in ("nvme", "network", "other") for d in kinds)


def test_evict_page_cache_makes_a_file_cold_and_says_so(disk_tmp_path) -> None:
    tmp_path = disk_tmp_path
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(8 << 20))
    path.read_bytes()
    assert disks.resident_fraction(path) > 0.9  # just written and read: in the page cache
    assert disks.evict_page_cache([path]) == "cold"
    assert disks.resident_fraction(path) < 0.02
    path.read_bytes()
    assert disks.resident_fraction(path) > 0.9
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert disks.resident_fraction(empty) == 0.0


# -- page cache: a folder on a disk, and evictions that fail --------------------------------------
import shutil  # noqa: E402  (kept with the tests below, so the top of the file stays as it was)
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_RAM_FS = ("tmpfs", "ramfs")


def _fstype(path: os.PathLike[str] | str) -> str:
    real = os.path.realpath(path)
    hits = [(len(m[1]), i, m[2]) for i, m in enumerate(disks._mounts())
            if m[1] == "/" or real == m[1] or real.startswith(m[1].rstrip("/") + "/")]
    return max(hits)[2] if hits else ""


@pytest.fixture
def disk_tmp_path(tmp_path: Path) -> Iterator[Path]:
    """A temporary folder on a disk: pages of a file on tmpfs live in RAM and cannot be evicted."""
    candidates = [tmp_path, Path(tempfile.gettempdir()), Path("/var/tmp"),
                  Path(__file__).resolve().parents[1] / ".pytest_cache"]
    for base in candidates:
        if base.is_dir() and os.access(base, os.W_OK) and _fstype(base) not in _RAM_FS:
            folder = Path(tempfile.mkdtemp(prefix="diag-evict-", dir=base))
            yield folder
            shutil.rmtree(folder, ignore_errors=True)
            return
    pytest.skip("every candidate temporary folder is on tmpfs/ramfs, whose pages cannot be "
                "evicted: " + ", ".join(f"{c} ({_fstype(c)})" for c in candidates))


def _cached(path: Path, size: int = 4 << 20) -> Path:
    path.write_bytes(os.urandom(size))
    path.read_bytes()
    assert disks.resident_fraction(path) > 0.9
    return path


def test_eviction_that_does_nothing_is_labelled_warm(disk_tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _cached(disk_tmp_path / "kept.bin")
    monkeypatch.setattr(disks.os, "posix_fadvise", lambda *args: None)  # the kernel ignores us
    label = disks.evict_page_cache([path])
    assert label == "warm (eviction failed: 100% still cached)"
    assert disks.resident_fraction(path) > 0.9  # the label agrees with what mincore measures


def test_one_file_left_cached_makes_the_whole_set_warm(disk_tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = _cached(disk_tmp_path / "a.bin"), _cached(disk_tmp_path / "b.bin")
    real, calls = os.posix_fadvise, []

    def only_first(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            real(fd, offset, length, advice)

    monkeypatch.setattr(disks.os, "posix_fadvise", only_first)
    label = disks.evict_page_cache([first, second])
    assert len(calls) == 2
    assert disks.resident_fraction(first) < 0.02 and disks.resident_fraction(second) > 0.9
    assert label.startswith("warm (eviction failed: ") and label.endswith("% still cached)")
    assert int(label.split(": ")[1].split("%")[0]) >= 90  # the worst file, not the best


def test_file_on_tmpfs_is_never_called_cold() -> None:
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and _fstype(shm) in _RAM_FS):
        pytest.skip("no writable tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir=shm) as folder:
        path = _cached(Path(folder) / "in-ram.bin")
        label = disks.evict_page_cache([path])
        assert label.startswith("warm (eviction failed: "), label
        assert disks.resident_fraction(path) > 0.9
