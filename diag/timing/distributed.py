"""Where this process sits in a torchrun / accelerate job, and what its gradient all-reduce waits.

`place()` is this rank's seat (rank, local rank, world, node, rendezvous address), read from
torch.distributed when a group is up, else from the launcher's environment (torchrun and
`accelerate launch` both set RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK).
`gather_to_root` collects each rank's frame on rank 0 once, at the end (never inside a step).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ROOT = 0  # the rank that gathers the frames and writes the run folder


@dataclass(frozen=True)
class Place:
    """One process's seat in the job; the single-process defaults when no launcher is around."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node: int = 0  # torchrun's GROUP_RANK (the --node_rank); 0 on one node
    address: str = ""  # MASTER_ADDR:MASTER_PORT, the rendezvous every rank dials

    @property
    def is_root(self) -> bool:
        return self.rank == ROOT

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class RendezvousError(RuntimeError):
    """This rank could not join the process group: its rank and the address it dialled."""


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else default
    except ValueError:
        raise ValueError(f"environment {name}={text!r}: the launcher sets it to a whole "
                         "number; unset it or launch with torchrun / accelerate") from None


def place() -> Place:
    """This process's rank, local rank, world size and node (from the group when it is up)."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    dist = _dist()
    if dist is not None and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    node = _env_int("GROUP_RANK", rank // max(local_world, 1))
    addr = os.environ.get("MASTER_ADDR", "")
    address = f"{addr}:{os.environ.get('MASTER_PORT', '')}" if addr else ""
    return Place(rank, _env_int("LOCAL_RANK", 0), world, local_world, node, address)


def _dist() -> Any:
    """torch.distributed if torch is already imported; never a reason to import torch."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # a torch build without it
        return None
    return dist if dist.is_available() else None


def launched() -> bool:
    """True under torchrun / accelerate with more than one process."""
    return _env_int("WORLD_SIZE", 1) > 1


RENDEZVOUS_TIMEOUT_S = 300.0  # how long a rank dials MASTER_ADDR:MASTER_PORT
                              # (env DIAG_RENDEZVOUS_TIMEOUT_S)


def init_group(device_type: str = "cpu", timeout_s: float | None = None) -> Place:
    """Join the launcher's process group (nccl on CUDA, gloo on CPU) unless one is up.

    A rank that cannot reach the rendezvous raises one RendezvousError naming its rank and the
    address it dialled (the CLI prints it as one line, exit 2), not a traceback per rank.
    """
    import torch.distributed as dist

    here = place()
    if not here.distributed or dist.is_initialized():
        return here
    if timeout_s is None:
        timeout_s = float(os.environ.get("DIAG_RENDEZVOUS_TIMEOUT_S") or RENDEZVOUS_TIMEOUT_S)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        import torch

        torch.cuda.set_device(here.local_rank)  # one GPU per rank, before NCCL picks one
    try:
        if here.rank != ROOT or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            _dial(here.address, timeout_s)  # a client of the store: is anyone there at all?
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as err:  # DistStoreError is a RuntimeError
        why = " ".join(str(err).split())[:200]
        raise RendezvousError(f"rank {here.rank} (node {here.node}) could not reach the "
                           f"rendezvous at {here.address or 'MASTER_ADDR:MASTER_PORT unset'} "
                           f"over {backend}: {why}") from None
    return place()


def _dial(address: str, timeout_s: float) -> None:
    """Wait until the rendezvous address accepts a connection; OSError naming it otherwise.

    torch's store client would retry too, but logs a C++ stack per attempt on every rank."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return  # nothing to dial: init_process_group names what is missing
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(timeout_s, 5.0)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise OSError(f"nothing answered there for {timeout_s:g} s ({err})") from None
            time.sleep(0.5)


def gather_to_root(obj: Any) -> list[Any] | None:
    """Every rank's obj on rank 0 (in rank order), None on the others; [obj] when alone.

    One collective at the end of a run (gloo or nccl: whichever the group uses; NCCL needs the
    pickled object on this rank's device, which gather_object handles)."""
    dist = _dist()
    if dist is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    if dist.get_backend() == "nccl":  # gather_object sends through this rank's current device
        import torch

        torch.cuda.set_device(place().local_rank)
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == ROOT else None
    dist.gather_object(obj, out, dst=ROOT)
    return out


def job_folder(base: Any) -> Any:
    """One folder for this job, the same name on every rank: rank 0 picks it and broadcasts it
    (one collective at the start, never in a step); each node creates it on its own disk."""
    from pathlib import Path

    name = [f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S.%fZ}-{os.getpid()}"]
    dist = _dist()
    if dist is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=ROOT)
    folder = Path(base) / name[0]
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def spill_ranks(timer: Any, seat: Place | None = None) -> None:
    """Under a launcher: the timer appends each finished step to
    <DIAG_HOME>/ranks/<job>/rank-<r>.partial.csv, so a killed job keeps them (read_spills)."""
    from diag.config import diag_home

    seat = seat or place()
    if seat.distributed and timer.enabled:
        folder = job_folder(diag_home() / "ranks")
        timer.spill_to(folder / f"rank-{seat.rank}.partial.csv")


def gathered_frame(timer: Any) -> Any:  # -> pandas.DataFrame
    """Every rank's frame on rank 0 (this rank's own elsewhere), gathered once at the end; the
    spilled copy is removed only after that, when the complete frame is safe."""
    frame = timer.gather(dst=ROOT) if place().distributed else timer.to_frame()
    if frame is None:
        frame = timer.to_frame()
    path = timer.spill_path
    timer.close_spill()
    if path is not None:
        with contextlib.suppress(OSError):  # the last rank on each node removes the folder
            path.parent.rmdir()
    return frame


@contextlib.contextmanager
def root_first() -> Iterator[None]:
    """Rank 0 runs the block first (fills shared caches on its node), then the others: two
    barriers around start-up work, never inside a step."""
    dist = _dist()
    up = dist is not None and dist.is_initialized() and dist.get_world_size() > 1
    if up and dist.get_rank() != ROOT:
        dist.barrier()
    yield
    if up and dist.get_rank() == ROOT:
        dist.barrier()


def speaks(err: BaseException | None = None) -> bool:
    """Rank 0 reports; another rank only reports what is its own (its rendezvous failed)."""
    try:
        return place().is_root or isinstance(err, RendezvousError)
    except ValueError:  # a garbled RANK: better every rank's line than none
        return True
