"""Launch a CPU/gloo world of N ranks without Lightning's subprocess launcher.

Ranks are forked from a *forkserver* that has already imported torch and Lightning, so a world of
8 ranks starts in seconds even on 2 cores. Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` and ``OMP_NUM_THREADS=1``, initialises a gloo process group with a
short timeout and runs ``fn(rank, *args)``. The return values come back as a list in rank order.
Reuse one world for many checks by making ``fn`` run them all. More modules for the forkserver to import once
are named in ``LIGHTNING_4D_WORLD_PRELOAD`` (comma-separated); what a rank inherits from it is frozen
(``gc.freeze``), so a garbage collection in the rank does not walk it. :class:`HostSyncCounter` (from
:mod:`lightning_4d.core.host_syncs`) counts a step's host syncs, in a world's rank or anywhere else.

Example:
    >>> def fn(rank):
    ...     import torch.distributed as dist
    ...     return dist.get_world_size()
    >>> # not run: needs a process group (spawns one process per rank)
    >>> run_world(fn, 2)  # doctest: +SKIP
    [2, 2]
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from lightning_4d.core.host_syncs import HostSyncCounter

__all__ = ["HostSyncCounter", "PRELOAD_ENV", "run_world", "WorldError", "free_port"]

_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_4d"]
PRELOAD_ENV = "LIGHTNING_4D_WORLD_PRELOAD"
"""Environment variable: more modules (comma-separated) for the forkserver to import once, before the first world
of this process starts (e.g. the model modules every rank imports); one that fails to import is skipped."""


class WorldError(RuntimeError):
    """Raised in the parent when a rank failed, timed out or died; carries every rank's traceback."""


def free_port() -> int:
    """Return a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out: str, pg_timeout_s: float,
    backend: str = "gloo",
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        LIGHTNING_4D_PG_TIMEOUT_S=str(pg_timeout_s),
    )
    import gc

    import torch
    import torch.distributed as dist

    # Objects inherited from the forkserver (the preloaded modules) are never garbage: freezing them keeps every
    # gc.collect() in the rank (the strategy's set-up runs one) from walking, and copying, the whole heap.
    gc.freeze()
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        # The parent holds the store's server (bound to a port the OS chose), so no rank races another process
        # for a port between choosing and binding it.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=pg_timeout_s))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        result = {"ok": True, "value": fn(rank, *args)}
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    try:
        with open(out, "wb") as fh:
            pickle.dump(result, fh)
    except Exception as err:  # unpicklable return value
        with open(out, "wb") as fh:
            pickle.dump({"ok": False, "error": f"result not picklable: {err}", "traceback": ""}, fh)
    if dist.is_initialized() and result["ok"]:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    # Skip interpreter teardown: a rank whose peers are gone must not block in atexit hooks.
    os._exit(0 if result["ok"] else 1)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    pg_timeout_s: float = 300.0,
    raise_on_error: bool = True,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` CPU ranks joined by a gloo process group.

    Args:
        fn: a picklable (module-level) function.
        world_size: number of ranks (1..8 on a laptop).
        timeout_s: wall-clock limit for the whole world; survivors are killed after it.
        pg_timeout_s: the process-group timeout, so a rank blocked on a dead peer fails fast.
        raise_on_error: raise :class:`WorldError` if any rank failed; otherwise return the
            per-rank result dicts ``{"ok", "value" | "error", "traceback"}``.
        backend: the default group's backend, a torch backend string: ``"cuda:gloo"`` lets ranks share one GPU
            (gloo on CUDA tensors, which refuses host tensors as NCCL does; NCCL refuses two ranks on one GPU).

    Example:
        >>> # not run: needs a process group (spawns one process per rank)
        >>> run_world(my_check, 4, "layout-a")  # doctest: +SKIP
    """
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    try:
        extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
        ctx.set_forkserver_preload(_PRELOAD + extra)
    except Exception:  # noqa: BLE001 - preload is an optimisation only
        pass
    import torch.distributed as dist

    # Port 0: the OS picks a free port and the server holds it for the world's whole life (a port chosen free and
    # bound later by rank 0 can be taken in between by a world another test process starts).
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = server.port
    with tempfile.TemporaryDirectory(prefix="l4d_world_") as tmp:
        outs = [str(Path(tmp) / f"rank{r}.pkl") for r in range(world_size)]
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, fn, args, outs[r], pg_timeout_s, backend),
                        daemon=True)
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        first_failure: float | None = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if now > deadline:
                break
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            # After one rank failed, the others get pg_timeout_s (+ slack) to fail on their own.
            if first_failure is not None and now - first_failure > pg_timeout_s + 30:
                break
            time.sleep(0.05)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        results: list[dict[str, Any]] = []
        for rank, out in enumerate(outs):
            if os.path.exists(out):
                with open(out, "rb") as fh:
                    results.append(pickle.load(fh))
            else:
                code = procs[rank].exitcode
                results.append({"ok": False, "error": f"rank {rank} produced no result (exit code {code})",
                                "traceback": ""})
    if not raise_on_error:
        return results
    failed = [(r, res) for r, res in enumerate(results) if not res["ok"]]
    if failed:
        msg = "\n\n".join(f"--- rank {r}: {res['error']}\n{res['traceback']}" for r, res in failed)
        raise WorldError(f"{len(failed)} of {world_size} ranks failed:\n{msg}")
    return [res["value"] for res in results]
