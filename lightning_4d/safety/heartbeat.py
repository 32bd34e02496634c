"""A frozen rank ends the run in about a minute, not after the 30-minute process-group timeout (on by default).

A rank that crashes closes its sockets and its peers fail at once (:mod:`lightning_4d.safety.peers` names it). A rank
that is *stopped* (``SIGSTOP``, a frozen node) or deadlocked while holding the GIL closes nothing: its peers
wait inside their next collective for the full process-group timeout. :class:`Heartbeat` runs two daemon
threads on every rank:

* the *beat* thread owns its own client of the rendezvous store (``MASTER_ADDR:MASTER_PORT``; no other thread
  touches it) and every ``timeout / 10`` seconds increments this rank's counter and reads everyone's. It is
  Python, so it stops when the rank is stopped or cannot get the GIL;
* the *watch* thread is pure Python (no torch object) and notices a store call that has not returned for
  ``timeout``: a store client call against a stopped store host blocks forever, whatever its own timeout.

When a peer's counter has not moved for ``timeout`` (counted only while this rank itself was running), or the
store does not answer, the rank prints which rank (pid, host) went silent and what to check, publishes that
verdict in the store so every survivor prints the same line, waits ``timeout / 10 + 1`` seconds so they all
can, ends silent ranks on its own host (``SIGKILL``: a stopped process would otherwise stay behind holding its
memory; never one held by a debugger) and exits with code 1. With the default 60 s a frozen rank ends the run
within about 80 s. A rank that finishes marks itself finished (and one that fails, failed) first, so a slower
or failed peer is never reported as frozen; if the store's host has exited the heartbeat ends quietly (the
transport names a dead rank). ``stop`` (the strategy's teardown, or an exit handler for a process that skips
it) waits for the threads: a daemon thread that returns from a store call into a finalizing interpreter aborts
the process.

Example:
    >>> beat = Heartbeat(rank=0, world_size=1, timeout_s=60.0)
    >>> beat.interval_s, worst_case_s(60.0)
    (6.0, 79.0)
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from lightning_4d.config import DEFAULT_HEARTBEAT_TIMEOUT
from lightning_4d.safety.peers import Peer, process_state

__all__ = ["DEFAULT_TIMEOUT", "Heartbeat", "silent_peers", "worst_case_s"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = DEFAULT_HEARTBEAT_TIMEOUT  # FourDStrategy(heartbeat_timeout=...)'s default (owned by the options)
_BEATS_PER_TIMEOUT = 10
_FINISHED, _FAILED = -1, -2  # a rank's last word in the store: never reported as silent
_THREAD_STACK_BYTES = 1 << 20  # the beat and watch threads run shallow Python and store calls
_GENERATION = [0]  # one namespace per set-up; every rank runs the same sequence of fits
_LIVE: weakref.WeakSet[Heartbeat] = weakref.WeakSet()  # started and not stopped yet


def worst_case_s(timeout_s: float) -> float:
    """Seconds from a rank freezing until every survivor has exited: the silence itself, up to two beat
    intervals to see it, and the grace in which every survivor prints the verdict.

    Example:
        >>> worst_case_s(60.0) <= 120
        True
    """
    interval = timeout_s / _BEATS_PER_TIMEOUT
    return timeout_s + 2 * interval + (interval + 1.0)


def silent_peers(counters: Sequence[int], seen: dict[int, tuple[int, float]], now: float, timeout_s: float,
                 me: int) -> list[int]:
    """Ranks whose counter has not changed for ``timeout_s`` (a negative counter: finished or failed, never
    silent). Updates ``seen`` (rank -> (last counter, when it last changed)). Pure apart from ``seen``.

    Example:
        >>> seen = {}
        >>> silent_peers([1, 1], seen, now=0.0, timeout_s=5, me=0), silent_peers([2, 1], seen, now=6.0, timeout_s=5, me=0)
        ([], [1])
        >>> silent_peers([3, -1], seen, now=20.0, timeout_s=5, me=0)  # rank 1 finished
        []
    """
    out = []
    for rank, value in enumerate(counters):
        if rank == me or value < 0:
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
        peers: ``(rank, host, pid)`` of every rank, for the message and to end silent ranks on this host.
        on_silent: called with the message instead of printing it, ending silent ranks and exiting (tests).
        namespace: prefix of this heartbeat's keys in the store; default: one per heartbeat made in this
            process (every rank sets up the same sequence of fits).
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, peers: Sequence[Peer] = (),
                 on_silent: Optional[Callable[[str], None]] = None, namespace: Optional[str] = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"heartbeat timeout {timeout_s} s must be > 0 (or None to disable the heartbeat).")
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.interval_s = self.timeout_s / _BEATS_PER_TIMEOUT
        self.peers = {p.rank: p for p in peers}
        self.on_silent = on_silent
        self._stop, self._done = threading.Event(), threading.Event()
        self._outcome = _FINISHED
        self._io_since: Optional[float] = None  # when the beat thread's current store call began
        self._reporting = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._address = ("", 0)
        _GENERATION[0] += 1
        self._prefix = namespace or f"lightning_4d/heartbeat/{_GENERATION[0]}"

    def start(self) -> None:
        """Start the threads (no-op for a single rank or without ``MASTER_ADDR`` / ``MASTER_PORT``)."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if self.world_size < 2 or not host or not port:
            return
        self._address = (host, int(port))
        _LIVE.add(self)
        self._threads = [threading.Thread(target=self._run_beats, name="lightning_4d-heartbeat", daemon=True),
                         threading.Thread(target=self._run_watch, name="lightning_4d-heartbeat-watch", daemon=True)]
        previous = threading.stack_size(_THREAD_STACK_BYTES)  # not the default 8 MiB each: counted in VmData
        try:
            for thread in self._threads:
                thread.start()
        finally:
            threading.stack_size(previous)

    def stop(self, finished: bool) -> None:
        """Stop beating after marking this rank finished (``True``) or failed (``False``) in the store; waits
        for the threads, so no thread is inside a store call when the process exits."""
        self._outcome = _FINISHED if finished else _FAILED
        self._stop.set()
        _LIVE.discard(self)
        for thread in self._threads:  # bounded: a store that stops answering is reported by the watch thread
            thread.join(timeout=self.timeout_s + 3 * self.interval_s)
        self._threads = []

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def _io(self, call: Callable[..., object], *args: object) -> object:
        self._io_since = time.monotonic()
        try:
            return call(*args)
        finally:
            self._io_since = None

    def _run_beats(self) -> None:
        store: Optional[dist.TCPStore] = None
        host, port = self._address
        try:  # a connection that fails raises within half the timeout, before the watch thread would report it
            store = self._io(lambda: dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                   timeout=timedelta(seconds=self.timeout_s / 2)))
            self._beat_until_stopped(store)
            self._io(store.set, self._key(self.rank), str(self._outcome))  # type: ignore[union-attr]
        except dist.DistNetworkError as err:
            if store is not None:  # the store's host exited: the run is ending (a dead rank is named by the
                log.debug("lightning_4d: rank %d: the heartbeat's store is gone (%s)", self.rank, err)  # transport)
            else:
                log.warning("lightning_4d: rank %d: the heartbeat could not reach the rendezvous store at %s:%s (%s); "
                            "a frozen rank is only found by the process-group timeout.", self.rank, host, port, err)
        except Exception as err:  # noqa: BLE001 - say so: only the process-group timeout is left
            if not self._stop.is_set():
                log.warning("lightning_4d: rank %d: the heartbeat stopped (%s: %s); a frozen rank is now only found "
                            "by the process-group timeout.", self.rank, type(err).__name__, err)
        finally:
            del store  # dropped by this thread: the main thread never touches the store
            self._done.set()

    def _beat_until_stopped(self, store: dist.TCPStore) -> None:
        keys = [self._key(r) for r in range(self.world_size)]
        verdict_key = f"{self._prefix}/verdict"
        seen: dict[int, tuple[int, float]] = {}
        started = last = time.monotonic()
        while True:
            self._io(store.add, self._key(self.rank), 1)
            if self._stop.wait(self.interval_s):
                return
            now = time.monotonic()
            if now - last > self.interval_s + self.timeout_s / 2:  # this rank itself was stopped or starved:
                seen.clear()                                      # start the peers' silence clocks again
                started = now
            last = now
            if self._io(store.check, [verdict_key]):
                verdict = json.loads(self._io(store.get, verdict_key))  # type: ignore[arg-type]
                self._report(verdict["what"], verdict["ranks"], until=verdict["until"], by=verdict["by"])
                return
            if not self._io(store.check, keys):
                if now - started > self.timeout_s:
                    self._report(f"not every rank started its heartbeat within {self.timeout_s:.0f} s of this one",
                                 [], store=store)
                    return
                continue
            counters = [int(v) for v in self._io(store.multi_get, keys)]  # type: ignore[attr-defined]
            silent = silent_peers(counters, seen, now, self.timeout_s, self.rank)
            if silent:
                verb = "has" if len(silent) == 1 else "have"
                self._report(f"{self._describe(silent)} {verb} sent no heartbeat for {self.timeout_s:.0f} s: stopped "
                             f"(SIGSTOP), frozen or deadlocked holding the GIL", silent, store=store)
                return

    def _run_watch(self) -> None:
        last = resumed = time.monotonic()
        while not self._done.wait(self.interval_s):
            now = time.monotonic()
            if now - last > self.interval_s + self.timeout_s / 2:
                resumed = now  # this rank was stopped: the store call's clock starts again
            last = now
            since = self._io_since
            if since is not None and now - max(since, resumed) > self.timeout_s:
                host, port = self._address
                stopped = [r for r, p in self.peers.items() if self._local(p) and process_state(p.pid) == "T"]
                here = f"; on this host {self._describe(stopped)} is stopped (SIGSTOP)" if stopped else ""
                self._report(f"the rendezvous store at {host}:{port} (kept by rank 0 under Lightning's launcher, by "
                             f"the torchrun agent under torchrun) has not answered for {self.timeout_s:.0f} s: its "
                             f"process is stopped (SIGSTOP), frozen or deadlocked{here}", stopped)
                if self.on_silent is None:  # the beat thread's own report is stuck in publishing its verdict
                    os._exit(1)
                return

    def _local(self, peer: Peer) -> bool:
        me = self.peers.get(self.rank)
        return peer.rank != self.rank and peer.host == (me.host if me else socket.gethostname())

    def _describe(self, ranks: Sequence[int]) -> str:
        peers = [self.peers.get(r) for r in ranks]
        return ", ".join(f"rank {p.rank} (pid {p.pid} on {p.host})" if p else f"rank {r}" for r, p in zip(ranks, peers))

    def _report(self, what: str, ranks: Sequence[int], until: Optional[float] = None, by: Optional[int] = None,
                store: Optional[dist.TCPStore] = None) -> None:
        """Print the verdict (publishing it when this rank found it), let the other survivors print it too, end
        the silent ranks on this host and exit."""
        if not self._reporting.acquire(blocking=False):
            return  # the other thread is reporting
        source = f" (found by rank {by})" if by is not None and by != self.rank else ""
        message = (f"rank {self.rank}: {what}{source}. Stopping this rank now instead of waiting for the "
                   f"process-group timeout; check that rank's host and its last output (FourDStrategy("
                   f"heartbeat_timeout=...) sets how long a silence is tolerated, None disables the heartbeat).")
        if self.on_silent is not None:
            self.on_silent(message)
            return
        print(f"lightning_4d: {message}", file=sys.stderr, flush=True)
        until = until if until is not None else time.time() + self.interval_s + 1.0
        if store is not None:  # the other survivors read it at their next beat
            try:
                self._io(store.set, f"{self._prefix}/verdict", json.dumps(dict(what=what, ranks=list(ranks),
                                                                               until=until, by=self.rank)))
            except Exception:  # noqa: BLE001 - they find the silence themselves one beat later
                pass
        time.sleep(max(0.0, min(until - time.time(), self.interval_s + 1.0)))
        for rank in ranks:
            peer = self.peers.get(rank)
            if peer is not None and self._local(peer) and process_state(peer.pid) not in (None, "Z", "t"):
                try:
                    os.kill(peer.pid, signal.SIGKILL)  # a stopped rank would stay behind holding its memory
                except OSError:
                    pass
        os._exit(1)


@atexit.register
def _stop_live_heartbeats() -> None:
    """At interpreter exit, before finalization, stop every heartbeat that was not stopped (a process that ends
    without the strategy's teardown): a daemon thread that returns from a store call into a finalizing
    interpreter aborts the process ("terminate called without an active exception")."""
    for beat in list(_LIVE):
        beat.stop(finished=False)
