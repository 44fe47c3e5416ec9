"""Checkpoints written whole, resume checks, and the adapter as output, for `diag qlora` and
`diag train`: nothing half-written ever looks complete."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from diag.files import atomic_file, atomic_folder, fsync_path, sweep_orphans, temp_path

RUN_FILE = "diag-run.json"  # what the run in a folder trains on: a resume must match it
PACKED_ROWS = ("\n\n## Packed rows\n\nTo feed several records in one row, restart `position_ids` "
               "at 0 for each record and pass `use_cache=False`: with a cache, transformers "
               "skips the packed-sequence mask and the records attend to each other.\n")


class Interrupted(KeyboardInterrupt):
    """Training stopped by signum after saving step's state: str() says how to resume."""

    def __init__(self, signum: int, step: int, out_dir: Path | str | None) -> None:
        where = (f"a checkpoint of step {step} is saved: run the same command with --resume "
                 f"--out-dir {out_dir} to continue" if out_dir else
                 "its checkpoint was in a temporary folder: name --out-dir to keep one")
        super().__init__(f"diag: stopped by {signal.Signals(signum).name} after step {step}; "
                         f"{where}")
        self.signum = signum


def checkpoints(folder: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete checkpoints in folder, by step: trainer_state.json present and naming it."""
    found = []
    for path in Path(folder).glob("checkpoint-*"):
        try:
            step = int(path.name.split("-")[1])
            state = json.loads((path / "trainer_state.json").read_text())
        except (ValueError, OSError):
            continue
        if state.get("global_step") == step:
            found.append((step, path))
    return sorted(found)


def last_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in folder, or None."""
    found = checkpoints(folder)
    return found[-1][1] if found else None


def check(out_dir: str | os.PathLike[str], run: dict[str, Any], resume: bool,
          folders: Iterable[str] = ("",)) -> dict[str, Any] | None:
    """Refuse an out_dir that does not fit this run, writing nothing; the run file's if resuming."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir={str(out)!r}: is a file; name a new folder or a run's own")
    step = max((s for f in folders for s, _ in checkpoints(out / f)), default=None)
    if step is not None and not resume:
        raise ValueError(f"--out-dir={str(out)!r} holds the checkpoints of another run (up to "
                         f"step {step}): pass --resume to continue it, or name a new folder")
    if step is None and resume:
        raise ValueError(f"--resume: {str(out)!r} holds no complete checkpoint to continue "
                         "from; run without --resume to start afresh there")
    path = out / RUN_FILE
    stored = json.loads(path.read_text()) if resume and path.is_file() else {}
    for key, value in run.items():
        if key in stored and stored[key] != value:
            raise ValueError(f"--resume: the run in {str(out)!r} was started with "
                             f"{key}={stored[key]!r}, this one asks {key}={value!r}; resume "
                             "with the same settings, or name a new --out-dir")
    return stored or None


def claim(out_dir: str | os.PathLike[str], run: dict[str, Any], resume: bool,
          folders: Iterable[str] = ("",)) -> dict[str, Any] | None:
    """`check`, then (unless resuming a recorded run) `run` written as the folder's run file."""
    stored = check(out_dir, run, resume, folders)
    if stored is None:
        record(out_dir, run, fresh=True)
    return stored


def record(out_dir: str | os.PathLike[str], run: dict[str, Any], fresh: bool = False) -> None:
    """Write out_dir's run file whole: `run` alone (fresh), or added to what it holds."""
    path = Path(out_dir) / RUN_FILE
    old = {} if fresh or not path.is_file() else json.loads(path.read_text())
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(old | run, indent=1, default=str))


def save_whole(final: Path, write: Callable[[Path], None], keep: int) -> None:
    """`write(tmp)` swapped in as `final`, the last `keep` kept; out of room: one line."""
    sweep_orphans(final.parent)  # what a save killed mid-way left
    try:
        with atomic_folder(final) as tmp:
            write(tmp)
    except (OSError, RuntimeError) as err:
        text = str(err).lower()  # out of room: torch's zip writer says it in a RuntimeError
        full = err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) if isinstance(
            err, OSError) else "file write failed" in text or "no space left" in text
        if not full:
            raise
        before = last_checkpoint(final.parent)
        raise RuntimeError(f"checkpoint {final.name}: writing under {final.parent} failed "
                           f"({getattr(err, 'strerror', None) or err}); nothing of it was kept, "
                           f"{before.name + ' is intact' if before else 'no earlier checkpoint'}"
                           ": free space, then continue with --resume") from None
    for _, old in checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def publish(out_dir: Path, write: Callable[[Path], None], last: str = "adapter_config.json"
            ) -> list[str]:
    """`write(tmp)`'s files moved into out_dir, fsynced, `last` last: never a part that loads."""
    tmp = temp_path(out_dir / "output")
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        names = sorted(os.listdir(tmp), key=lambda n: n == last)
        for name in names:
            fsync_path(tmp / name)
        for name in names:
            os.replace(tmp / name, out_dir / name)
        fsync_path(out_dir)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def merged(base_folder: Path, adapter_dir: Path, out: Path, dtype: Any = None) -> Path:
    """The base reloaded in 16-bit with the adapter merged in, saved whole at out."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=dtype or torch.bfloat16)
    model = merge_into(PeftModel.from_pretrained(base, adapter_dir))
    model.config.use_cache = False  # generate() keeps its own (generation_config.use_cache)
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(tmp)
    return out


def merge_into(model: Any) -> Any:
    """merge_and_unload, refused on a 4-bit base (rounded back to nf4, the update is lost)."""
    if getattr(model, "is_loaded_in_4bit", False) or getattr(
            getattr(model, "base_model", None), "is_loaded_in_4bit", False):
        raise ValueError("merge: the base is loaded in 4-bit; merged weights would be rounded "
                         "back to nf4 and lose most of the adapter's update: reload the base in "
                         "16-bit (diag train --merge does) and merge there")
    return model.merge_and_unload()
