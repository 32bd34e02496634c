"""Name the peer that died: turn "Connection closed by peer [127.0.0.1]:40123" into a line a user can act on.

When a rank dies (killed, out of memory, a crash in its own code) the others fail inside their next
collective with a transport error that names no rank. At set-up every rank records ``(rank, host, pid)`` of
all ranks (:func:`gather_peers`, one small all-gather); when a step then fails with a communication error,
:func:`describe_peer_failure` checks which ranks on this host have exited and which collective this rank was
in (from the traceback), and the strategy puts that line in front of the error.

Example:
    >>> peers = [Peer(0, "node-a", 100), Peer(1, "node-a", 101)]
    >>> describe_peer_failure(RuntimeError("Connection closed by peer [127.0.0.1]:4000"), peers, 0,
    ...                       alive=lambda pid: pid != 101)  # doctest: +ELLIPSIS
    'rank 0: a collective failed because a peer is gone: rank 1 (pid 101 on node-a) has exited. ...'
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch.distributed as dist

__all__ = ["Peer", "gather_peers", "describe_peer_failure", "is_comm_failure", "pid_alive", "process_state"]

_COMM_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset",
                 "timed out", "timeout", "nccl", "gloo", "socket", "connection refused", "closed by remote")


@dataclass(frozen=True)
class Peer:
    """One rank's process: global rank, host name and pid."""

    rank: int
    host: str
    pid: int


def gather_peers() -> list[Peer]:
    """Every rank's :class:`Peer` (a collective on the default group; ``[]`` without one).

    Example:
        >>> # not run: needs a process group
        >>> gather_peers()  # doctest: +SKIP
        [Peer(rank=0, host='node-a', pid=4242), Peer(rank=1, host='node-a', pid=4243)]
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    mine = Peer(dist.get_rank(), socket.gethostname(), os.getpid())
    everyone: list[Optional[Peer]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [p for p in everyone if p is not None]


def process_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` on this host from ``/proc`` (``R`` running, ``S`` sleeping, ``T``
    stopped, ``t`` held by a debugger, ``Z`` exited but not reaped, ...); ``None`` if it is gone or unknown.

    Example:
        >>> process_state(os.getpid()) in ("R", "S")
        True
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host is running (a zombie — exited, not yet reaped — counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(pid) != "Z"


def is_comm_failure(err: BaseException) -> bool:
    """A transport / collective failure (gloo, NCCL, sockets, timeouts) rather than an error of the model.

    Example:
        >>> is_comm_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
        True
        >>> is_comm_failure(ValueError("shape mismatch"))
        False
    """
    if type(err).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in text for m in _COMM_MARKERS)


def _where(err: BaseException) -> str:
    """The collective this rank was in and the package / user frame that called it, from the traceback."""
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
    collective = next((f for f in reversed(frames) if f.filename.endswith(("distributed_c10d.py",
                                                                          "_functional_collectives.py"))), None)
    caller = next((f for f in reversed(frames) if "torch" + os.sep not in f.filename
                   and "lightning" + os.sep + "pytorch" not in f.filename), None)
    parts = []
    if collective is not None:
        parts.append(f"torch.distributed.{collective.name}")
    if caller is not None:
        parts.append(f"called from {os.path.basename(caller.filename)}:{caller.lineno} ({caller.name})")
    return " ".join(parts) if parts else "a collective"


def describe_peer_failure(err: BaseException, peers: Sequence[Peer], rank: int,
                          alive: Callable[[int], bool] = pid_alive, wait_s: float = 1.0) -> Optional[str]:
    """One line naming the ranks on this host that have exited (waiting up to ``wait_s`` for a dying peer to
    finish exiting), the collective this rank was in, and what to look at; ``None`` if ``err`` is not a
    communication failure or no peers are known.

    Example:
        >>> describe_peer_failure(ValueError("bad input"), [], 0) is None
        True
    """
    if not peers or not is_comm_failure(err):
        return None
    host = next((p.host for p in peers if p.rank == rank), socket.gethostname())
    local = [p for p in peers if p.host == host and p.rank != rank]
    deadline = time.monotonic() + wait_s
    dead = [p for p in local if not alive(p.pid)]
    while not dead and local and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = [p for p in local if not alive(p.pid)]
    where = _where(err)
    if dead:
        names = ", ".join(f"rank {p.rank} (pid {p.pid} on {p.host})" for p in dead)
        verb = "has" if len(dead) == 1 else "have"
        return (f"rank {rank}: a collective failed because a peer is gone: {names} {verb} exited. This rank was in "
                f"{where}. The cause is in the first error of {'that rank' if len(dead) == 1 else 'those ranks'}.")
    others = sorted({p.host for p in peers if p.host != host})
    elsewhere = (f"a rank on another host ({', '.join(others)}) may have failed, or " if others else "")
    return (f"rank {rank}: a collective failed ({where}) but no other rank on {host} has exited: {elsewhere}a peer "
            f"is stuck or too slow (past the process-group timeout), or the network failed.")
