"""A frozen rank stops the run in seconds, not after the 30-minute process-group timeout.

A rank that crashes closes its sockets and its peers fail at once (:mod:`lightning_4d.peers` names it). A rank
that is *stopped* (``SIGSTOP``, a debugger, a frozen node) or deadlocked while holding the GIL closes nothing:
its peers wait inside their next collective for the full process-group timeout. :class:`Heartbeat` runs a
daemon thread on every rank that increments the rank's counter in the rendezvous store every
``timeout / 6`` seconds (``MASTER_ADDR:MASTER_PORT``, its own client with its own timeout) and reads everyone's.
The thread runs while the main thread computes or waits, so only a rank that cannot run at all goes silent.
When a peer's counter has not moved for ``timeout`` seconds (or the store itself stops answering), the thread
prints which rank (pid, host) went silent and ends this process with exit code 1. A rank that finishes
normally says so in the store first, so a slower peer is never mistaken for a frozen one.

Example:
    >>> beat = Heartbeat(rank=0, world_size=1, timeout_s=60.0)
    >>> beat.interval_s
    10.0
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from lightning_4d.peers import Peer

__all__ = ["Heartbeat", "silent_peers"]

_GENERATION = [0]  # one namespace per set-up; every rank runs the same sequence of fits


def silent_peers(counters: Sequence[Optional[int]], seen: dict[int, tuple[Optional[int], float]], now: float,
                 timeout_s: float, me: int) -> list[int]:
    """Ranks whose counter has not changed for ``timeout_s`` (``None``: finished, never silent). Updates
    ``seen`` (rank -> (last counter, when it last changed)). Pure apart from ``seen``.

    Example:
        >>> seen = {}
        >>> silent_peers([1, 1], seen, now=0.0, timeout_s=5, me=0), silent_peers([2, 1], seen, now=6.0, timeout_s=5, me=0)
        ([], [1])
    """
    out = []
    for rank, value in enumerate(counters):
        if rank == me or value is None:
            continue
        last = seen.get(rank)
        if last is None or last[0] != value:
            seen[rank] = (value, now)
        elif now - last[1] > timeout_s:
            out.append(rank)
    return out


class Heartbeat:
    """Liveness of every rank through the rendezvous store (see the module docstring).

    Args:
        rank / world_size: this rank and the world.
        timeout_s: silence after which a peer counts as frozen.
        peers: ``(rank, host, pid)`` of every rank, for the message.
        on_silent: called with the message instead of printing it and exiting (tests).
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, peers: Sequence[Peer] = (),
                 on_silent: Optional[Callable[[str], None]] = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"heartbeat timeout {timeout_s} s must be > 0 (or None to disable the heartbeat).")
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval_s = self.timeout_s / 6
        self.peers = {p.rank: p for p in peers}
        self.on_silent = on_silent
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store: Optional[dist.TCPStore] = None
        _GENERATION[0] += 1
        self._prefix = f"lightning_4d/heartbeat/{_GENERATION[0]}"

    def start(self) -> None:
        """Connect to the store and start the thread (no-op for a single rank or without ``MASTER_ADDR``)."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if self.world_size < 2 or not host or not port:
            return
        self._store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout_s))
        self._store.add(self._key(self.rank), 1)
        self._thread = threading.Thread(target=self._run, name="lightning_4d-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, finished: bool) -> None:
        """Stop the thread; ``finished=True`` tells the peers this rank ended normally (never report it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        if finished and self._store is not None:
            try:
                self._store.set(self._key(self.rank), "-1")  # finished: never silent
            except Exception:  # noqa: BLE001 - best effort: the store may be gone at shutdown
                pass

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def _read(self) -> Optional[list[Optional[int]]]:
        """Every rank's counter (``None``: finished), or ``None`` while some rank has not started yet."""
        assert self._store is not None
        keys = [self._key(r) for r in range(self.world_size)]
        if not self._store.check(keys):
            return None
        return [None if int(v) < 0 else int(v) for v in self._store.multi_get(keys)]

    def _run(self) -> None:
        seen: dict[int, tuple[Optional[int], float]] = {}
        start = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._store.add(self._key(self.rank), 1)  # type: ignore[union-attr]
                counters = self._read()
            except Exception as err:  # noqa: BLE001 - the store host is frozen or gone
                if self._stop.is_set():
                    return
                self._report(f"the rendezvous store ({os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}, "
                             f"kept by rank 0 or the launcher) did not answer within {self.timeout_s:.0f} s "
                             f"({type(err).__name__}): rank 0 is stopped, frozen or gone")
                return
            if counters is None:
                if now - start > self.timeout_s:
                    self._report(f"not every rank started its heartbeat within {self.timeout_s:.0f} s of this one")
                    return
                continue
            silent = silent_peers(counters, seen, now, self.timeout_s, self.rank)
            if silent:
                names = ", ".join(self._describe(r) for r in silent)
                verb = "has" if len(silent) == 1 else "have"
                self._report(f"{names} {verb} sent no heartbeat for {self.timeout_s:.0f} s: stopped (SIGSTOP), frozen "
                             f"or deadlocked")
                return

    def _describe(self, rank: int) -> str:
        peer = self.peers.get(rank)
        return f"rank {rank} (pid {peer.pid} on {peer.host})" if peer else f"rank {rank}"

    def _report(self, what: str) -> None:
        message = (f"rank {self.rank}: {what}. Stopping this rank now instead of waiting for the process-group "
                   f"timeout (FourDStrategy(heartbeat_timeout=...) sets how long a silence is tolerated).")
        if self.on_silent is not None:
            self.on_silent(message)
            return
        print(f"lightning_4d: {message}", file=sys.stderr, flush=True)
        os._exit(1)
