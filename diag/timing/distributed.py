"""Where this process sits in a torchrun / accelerate job, and how it ends there: `place()` is
this rank's seat, `gather_to_root` collects each rank's frame on rank 0 once at the end, finished
steps are spilled as they go (*.partial.csv, never a complete run; `read_spills` reads them back),
`ending(err)` names the rank a failed collective lost.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = 0  # the rank that gathers the frames and writes the run folder
SPILL_COLUMNS = ("stage", "seconds", "step", "rank", "node")  # of a rank's *.partial.csv
# How long a rank waits, each bound apart (env DIAG_<NAME>_TIMEOUT_S overrides):
TIMEOUTS_S = {"rendezvous": 300.0,  # to reach MASTER_ADDR:MASTER_PORT and the other ranks
              "collective": 600.0,  # in one collective of the job (a gather, an all-reduce)
              "fill": 1800.0,  # for another rank or process to fill a cache (a first download)
              "roll_call": 3.0,  # a collective failed: for a rank to answer (this node's: or end)
              "say": 20.0}  # for this node's other ranks to say their refusal before it exits
_store: Any = None  # the rendezvous store of the group init_group made (root_first waits on it)
_spilling: Any = None  # the folder this rank spills into until its frame is gathered
_firsts = 0  # root_first blocks entered so far: the same count on every rank


@dataclass(frozen=True)
class Place:
    """One process's seat in the job; the single-process defaults when no launcher is around."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
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


class RankLost(RuntimeError):
    """A collective failed because other ranks stopped answering: who, and during which step."""


def _number(name: str, default: Any, kind: type = int, want: str = "") -> Any:
    text = os.environ.get(name, "")
    try:
        return kind(text) if text else default
    except ValueError:
        raise ValueError(f"environment {name}={text!r}: " + (want or "the launcher sets it to a "
                         "whole number; unset it or launch with torchrun / accelerate")) from None


def place() -> Place:
    """This process's rank, local rank, world size and node (from the group when it is up)."""
    rank, world = _number("RANK", 0), _number("WORLD_SIZE", 1)
    dist = _dist()
    if dist is not None and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    node = _number("GROUP_RANK", rank // max(_number("LOCAL_WORLD_SIZE", world), 1))
    addr = os.environ.get("MASTER_ADDR", "")
    return Place(rank, _number("LOCAL_RANK", 0), world, node,
                 f"{addr}:{os.environ.get('MASTER_PORT', '')}" if addr else "")


def _dist() -> Any:
    """torch.distributed if torch is already imported; never a reason to import torch."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # a torch build without it
        return None
    return dist if dist.is_available() else None


def _group() -> Any:
    """torch.distributed when several ranks are up, else None (on NCCL: the rank's device set)."""
    dist = _dist()
    if dist is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "nccl":
        import torch

        torch.cuda.set_device(place().local_rank)
    return dist


def launched() -> bool:
    """True under torchrun / accelerate with more than one process."""
    return _number("WORLD_SIZE", 1) > 1


def timeout_s(name: str) -> float:
    return _number(f"DIAG_{name.upper()}_TIMEOUT_S", TIMEOUTS_S[name], float, "a number of seconds")


def init_group(device_type: str = "cpu") -> Place:
    """Join the launcher's process group (nccl on CUDA, gloo on CPU), else RendezvousError."""
    import torch.distributed as dist

    global _store
    here = place()
    if not here.distributed or dist.is_initialized():
        return here
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        import torch

        torch.cuda.set_device(here.local_rank)  # one GPU per rank, before NCCL picks one
    rendezvous = datetime.timedelta(seconds=timeout_s("rendezvous"))
    collective = datetime.timedelta(seconds=timeout_s("collective"))
    try:
        if here.rank != ROOT or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            _dial(here.address, rendezvous.total_seconds())  # a store client: anyone there?
        # env:// rendezvous, then the group on its store (init_process_group: one timeout for both)
        store, rank, world = next(dist.rendezvous("env://", timeout=rendezvous))
        store.set_timeout(collective)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=collective)
    except (RuntimeError, ValueError, OSError) as err:  # DistStoreError is a RuntimeError
        raise RendezvousError(f"could not reach the rendezvous at "
                              f"{here.address or 'MASTER_ADDR:MASTER_PORT unset'} over "
                              f"{backend}: {' '.join(str(err).split())[:200]}") from None
    _store = store
    store.set(f"diag/seat/{rank}", f"{place().node} {os.getpid()}")  # for a roll call (ending)
    return place()


def agree(cfg: Any) -> None:
    """ValueError naming the ranks and fields whose config differs from rank 0's (a collective)."""
    dist = _group()
    if dist is None:
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"command": type(cfg).__name__, **cfg.to_dict()})
    root = every[ROOT]
    differ = [f"rank {rank}: " + ", ".join(fields) for rank, theirs in enumerate(every)
              if (fields := [f"{k}={theirs.get(k)!r} (rank 0: {root.get(k)!r})"
                             for k in sorted(set(theirs) | set(root))
                             if theirs.get(k) != root.get(k)])]
    if differ:
        raise ValueError("the ranks were launched with different arguments: " + "; ".join(differ)
                         + "; give every rank the same command")


def _dial(address: str, timeout_s: float) -> None:
    """Wait for the rendezvous address to take a connection; OSError naming it otherwise."""
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
    """Every rank's obj on rank 0 in rank order, None on the others, [obj] when alone."""
    dist = _group()
    if dist is None:
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == ROOT else None
    dist.gather_object(obj, out, dst=ROOT)
    return out


def spill_ranks(timer: Any, seat: Place | None = None) -> None:
    """Under a launcher, spill the timer's steps to <DIAG_HOME>/ranks/<job>/rank-<r>.partial.csv."""
    from diag.config import diag_home

    global _spilling
    seat = seat or place()
    if seat.distributed and timer.enabled:
        name = [f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S.%fZ}-{os.getpid()}"]
        if (dist := _group()) is not None:
            dist.broadcast_object_list(name, src=ROOT)
        _spilling = diag_home() / "ranks" / name[0]
        _spilling.mkdir(parents=True, exist_ok=True)  # each node on its own disk
        timer.spill_to(_spilling / f"rank-{seat.rank}.partial.csv")
        atexit.unregister(_pointer)
        atexit.register(_pointer)


def _pointer() -> None:
    if _spilling is not None:
        _quiet()
        sys.stderr.write(f"diag: {who()}stopped before the end of the run; the steps it "
                         f"finished are in {_spilling} (`diag report {_spilling}` reads every "
                         "rank's)\n")


def _quiet() -> None:
    """The run is over: a launcher's SIGTERM must not cut its last lines."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def ending(err: BaseException) -> BaseException:
    """err, or RankLost naming the ranks a failed collective lost; SIGTERM ignored from here on."""
    if not launched():
        return err
    _quiet()
    if _store is None or not isinstance(err, RuntimeError) or not any(
            w in str(err).lower() for w in ("connection", "broken pipe", "timed out", "nccl")):
        return err
    try:
        gone = _roll_call(place())
    except (RuntimeError, OSError, ValueError):  # the store went too: err as it is
        gone = []
    if not gone:
        return err
    when = "before its first timed step"
    if _spilling is not None:
        rows = read_spills(_spilling)
        done = rows.loc[rows["rank"] == place().rank, "step"].dropna()
        when = f"during step {int(done.max()) + 1}" if len(done) else when
    names = ", ".join(f"rank {r} (node {n})" for r, n in gone)
    return RankLost(f"{names} stopped answering {when}; its own output says why")


def _roll_call(seat: Place) -> list[tuple[int, int]]:
    """(rank, node) of the ranks whose process ended, or (another node) did not answer in time."""
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    _store.set(f"diag/here/{seat.rank}", "1")
    deadline, gone = time.monotonic() + timeout_s("roll_call"), []
    for rank in range(seat.world_size):
        if rank == seat.rank or not _store.check([f"diag/seat/{rank}"]):
            continue
        node, pid = map(int, _store.get(f"diag/seat/{rank}").split())
        # another node's rank: its answer; this node's: its process too, given the roll call's
        # time to end (a busy box runs a kill late)
        while time.monotonic() < deadline and not _store.check([f"diag/here/{rank}"]):
            if node == seat.node and not alive(pid):
                break
            time.sleep(0.1)
        here = _store.check([f"diag/here/{rank}"]) or node == seat.node and alive(pid)
        if not here:
            gone.append((rank, node))
    return gone


def spilled() -> Path | None:
    """The folder of this rank's spill of a run that has not ended (stopped or failed)."""
    return _spilling


def read_spills(folder: Any) -> Any:  # -> pandas.DataFrame
    """Every rank's spilled rows in one frame; a line cut short by a kill is dropped."""
    import pandas as pd

    frames = []
    for path in sorted(Path(folder).glob("rank-*.partial.csv")):
        whole = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                 if line.endswith("\n") and line.count(",") == len(SPILL_COLUMNS) - 1]
        if len(whole) > 1:
            frames.append(pd.read_csv(io.StringIO("".join(whole))))
    if not frames:
        return pd.DataFrame(columns=list(SPILL_COLUMNS))
    return pd.concat(frames, ignore_index=True).astype({"step": "Int64"})


def gathered_frame(timer: Any) -> Any:  # -> pandas.DataFrame
    """Every rank's frame on rank 0 (its own elsewhere), once at the end; then the spills go."""
    global _spilling
    frame, path, _spilling = timer.gather(dst=ROOT), timer.spill_path, None
    timer.close_spill()
    if path is not None:
        with contextlib.suppress(OSError):  # the last rank on each node removes the folder
            path.parent.rmdir()
    return frame


@contextlib.contextmanager
def root_first() -> Iterator[None]:
    """Rank 0 runs the block first (fills the caches), the others after, up to timeout_s("fill")."""
    global _firsts
    dist, _firsts = _group(), _firsts + 1
    key = f"diag/root_first/{_firsts}"
    if dist is not None and dist.get_rank() != ROOT:
        if _store is not None:
            _store.wait([key], datetime.timedelta(seconds=timeout_s("fill")))
        else:
            dist.barrier()
    try:
        yield
    finally:  # a block that raised on rank 0 still lets the others go (and say their own error)
        if dist is not None and dist.get_rank() == ROOT:
            if _store is not None:
                _store.set(key, "done")
            else:
                dist.barrier()


def who() -> str:
    """A rank's line's start under a launcher ("rank 1 (node 0): "); "" on one process."""
    try:
        seat = place()
    except ValueError:  # a garbled RANK: the line still reaches the user, unnamed
        return ""
    return f"rank {seat.rank} (node {seat.node}): " if seat.distributed else ""
