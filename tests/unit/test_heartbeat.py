"""The heartbeat against a real rendezvous store in this process: live, finished and failed ranks are never
reported; a silent one is, after the timeout and not before; a published verdict is repeated; a stopped store
host (whose calls block forever whatever the client's timeout) is reported by the watch thread; the threads
are gone after ``stop``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Iterator

import pytest
import torch.distributed as dist

from lightning_4d.safety.heartbeat import DEFAULT_TIMEOUT, Heartbeat, worst_case_s
from lightning_4d.safety.peers import Peer, process_state
from lightning_4d.testing import free_port

TIMEOUT = 1.5  # seconds; beats every 0.15 s
PEERS = [Peer(0, "node-a", 4000), Peer(1, "node-a", 4001), Peer(2, "node-b", 4002)]


class _Reports:
    def __init__(self) -> None:
        self.messages: list[tuple[float, str]] = []
        self.event = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append((time.monotonic(), message))
        self.event.set()


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield master


def _beats(world: int, ranks: list[int], timeout: float = TIMEOUT) -> tuple[list[Heartbeat], list[_Reports]]:
    reports = [_Reports() for _ in ranks]
    namespace = f"test/{time.monotonic_ns()}"  # the ranks of one world, all in this process
    beats = [Heartbeat(r, world, timeout, PEERS[:world], on_silent=rep, namespace=namespace)
             for r, rep in zip(ranks, reports)]
    return beats, reports


def test_the_default_ends_a_frozen_run_within_two_minutes() -> None:
    assert worst_case_s(DEFAULT_TIMEOUT.total_seconds()) <= 120


def test_live_finished_and_failed_ranks_are_never_reported(store: dist.TCPStore) -> None:
    timeout = 6.0  # live beats every 0.6 s: a margin for a loaded machine
    beats, reports = _beats(3, [0, 1, 2], timeout)
    for beat in beats:
        beat.start()
    time.sleep(timeout)
    beats[1].stop(finished=True)
    beats[2].stop(finished=False)
    time.sleep(1.5 * timeout)  # ranks 1 and 2 are silent for longer than the timeout, but said why
    beats[0].stop(finished=True)
    assert [r.messages for r in reports] == [[], [], []]
    assert [store.get(beats[0]._key(r)) for r in range(3)] == [b"-1", b"-1", b"-2"]
    assert not any(t.name.startswith("lightning_4d-heartbeat") for t in threading.enumerate())


def test_a_silent_rank_is_named_after_the_timeout_and_not_before(store: dist.TCPStore) -> None:
    (beat,), (report,) = _beats(3, [0])
    store.set(beat._key(1), "7")  # rank 1 beat once, then froze; rank 2 finished
    store.set(beat._key(2), "-1")
    start = time.monotonic()
    beat.start()
    assert report.event.wait(60), "no report"
    beat.stop(finished=False)
    when, message = report.messages[0]
    assert when - start > TIMEOUT
    assert message.startswith("rank 0: rank 1 (pid 4001 on node-a) has sent no heartbeat for 2 s: stopped (SIGSTOP)")
    assert "heartbeat_timeout" in message and len(report.messages) == 1


def test_a_published_verdict_is_repeated_by_every_survivor(store: dist.TCPStore) -> None:
    beats, reports = _beats(3, [0, 1])
    store.set(beats[0]._key(2), "1")
    store.set(f"{beats[0]._prefix}/verdict", json.dumps(dict(what="rank 2 (pid 4002 on node-b) has sent no heartbeat",
                                                              ranks=[2], until=time.time(), by=2)))
    for beat in beats:
        beat.start()
    for report in reports:
        assert report.event.wait(60), "no report"
    for beat in beats:
        beat.stop(finished=False)
    for rank, report in enumerate(reports):
        assert report.messages[0][1].startswith(f"rank {rank}: rank 2 (pid 4002 on node-b) has sent no heartbeat "
                                                f"(found by rank 2).")


def test_a_stopped_store_host_is_reported_by_the_watch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    code = ("import time, torch.distributed as d; "
            f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
            "print('up', flush=True); time.sleep(600)")
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "up"
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        peers = [Peer(0, "node-a", host.pid), Peer(1, "node-a", os.getpid())]
        report = _Reports()
        beat = Heartbeat(1, 2, TIMEOUT, peers, on_silent=report)
        beat.start()
        time.sleep(TIMEOUT / 2)  # connected and beating
        os.kill(host.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(host.pid) != "T" and time.monotonic() < deadline:  # the signal lands asynchronously
            time.sleep(0.01)
        assert process_state(host.pid) == "T"
        assert report.event.wait(60), "no report"
        message = report.messages[0][1]
        assert f"the rendezvous store at 127.0.0.1:{port}" in message and "has not answered for 2 s" in message
        assert f"on this host rank 0 (pid {host.pid} on node-a) is stopped (SIGSTOP)" in message
    finally:
        host.kill()  # the beat thread's blocked call now fails and the thread ends
        host.wait()
    beat.stop(finished=False)
    assert not any(t.name.startswith("lightning_4d-heartbeat") for t in threading.enumerate())
    assert process_state(host.pid) is None


def test_one_rank_or_no_rendezvous_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for beat in (Heartbeat(0, 1, TIMEOUT), Heartbeat(0, 2, TIMEOUT)):
        beat.start()
        assert beat._threads == []
        beat.stop(finished=True)
    with pytest.raises(ValueError, match="must be > 0"):
        Heartbeat(0, 2, 0.0)


def test_a_process_that_exits_without_stopping_it_stops_it_first(store: dist.TCPStore) -> None:
    # No teardown: the exit handler stops the threads (marking the rank failed) before the interpreter finalizes,
    # so no thread returns from a store call into a finalizing interpreter (which aborts the process).
    namespace = f"test/{time.monotonic_ns()}"
    code = ("import time; from lightning_4d.safety.heartbeat import Heartbeat; "
            f"Heartbeat(1, 2, 1.0, namespace={namespace!r}).start(); time.sleep(0.5)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert store.get(f"{namespace}/1") == b"-2"
