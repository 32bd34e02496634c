"""Checkpoints written in the background: training goes on while the files are written, hashed and swapped in.

``FourDStrategy(async_checkpoint=True)`` saves with DCP's ``async_save``. The call blocks only while this rank's
shards are copied to host memory (DCP's ``DefaultStager``: pinned buffers and a non-blocking copy on a GPU, plain
host buffers on the CPU; kept between saves, so a rank holds one staged copy of its own share of the model and
optimizer state, never more) and ``meta.pt``'s bytes are taken. Then DCP writes the shards in a thread, and a second
thread of this module waits for it and finishes the save exactly as a synchronous one does
(:func:`~lightning_4d.checkpoint.state.save_sharded`): each rank hashes a share of the files, rank 0 writes
``meta.pt``, the manifest and the ``.complete`` marker and swaps ``<path>.partial`` into ``<path>``. Until then the
previous checkpoint is untouched: a rank killed during the background write leaves an incomplete ``.partial``
(skipped by :func:`~lightning_4d.checkpoint.latest.latest_checkpoint`, refused by a load), and checkpoints that
``ModelCheckpoint`` asks to remove meanwhile are removed only after the new one is complete.

The background collectives (DCP's planning, the hashing's exchange) run on a gloo group of their own, created at the
first save: host tensors on a host group, never beside the training's collectives on the default (NCCL) group.
One save is in flight at a time: a second save waits for the first, and so do a load, the preemption save
(:mod:`lightning_4d.safety.preemption`) and the end of training (the strategy's ``teardown``). A failed background
save raises :class:`~lightning_4d.checkpoint.state.CheckpointSaveError` on every rank at the next of those waits (and
is logged by the first step that sees it); it is never dropped.

Example:
    >>> saver = BackgroundSaver()
    >>> saver.in_flight, saver.wait()
    (False, None)
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_4d.checkpoint.state import (_begin_save, _dcp_state, _finish_save, _first_line, _meta_bytes,
                                           _rng_state)

__all__ = ["BackgroundSaver"]

log = logging.getLogger(__name__)


class _HostStager:
    """DCP's ``DefaultStager`` staging at once (the copy is complete when ``stage`` returns, so the training may change
    the weights right after): pinned memory and a non-blocking copy for accelerator tensors. Its buffers are cached
    per source tensor and reused by the next save (only once the previous save is written: the saver waits)."""

    should_synchronize_after_execute = False  # AsyncStager protocol: nothing left to wait for after `stage`

    def __init__(self, device: torch.device) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        accelerator = device.type != "cpu"
        self._inner = DefaultStager(StagingOptions(use_pinned_memory=accelerator and torch.cuda.is_available(),
                                                   use_shared_memory=False, use_async_staging=False,
                                                   use_non_blocking_copy=accelerator))
        self.staged_bytes = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = self._inner.stage(state_dict)
        self.staged_bytes = _host_bytes(staged)
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._inner.close()


class BackgroundSaver:
    """One rank's background checkpoint saves (module docstring); call every method on every rank.

    Args:
        timeout: the timeout of the saves' own gloo group (the strategy passes its process-group ``timeout``).

    Example:
        >>> # not run: needs files (writes a checkpoint)
        >>> saver.save(checkpoint, "ckpts/step=10.ckpt", True, torch.device("cpu"))  # doctest: +SKIP
        >>> saver.wait()  # doctest: +SKIP
    """

    def __init__(self, timeout: Optional[timedelta] = None) -> None:
        self.timeout = timeout
        self._group: Optional[dist.ProcessGroup] = None
        self._stager: Optional[_HostStager] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self._reported = False
        self._lock = threading.Lock()
        self._after: Optional[list[Callable[[], None]]] = None  # run once the save in flight is complete
        self._succeeded: Optional[bool] = None  # the save in flight, finished but not yet waited for

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a strategy is) until the first save: no lock, thread or process group yet."""
        if self._group is not None or self._executor is not None or self._stager is not None:
            raise TypeError("A BackgroundSaver that has saved cannot be pickled (it holds a thread, staging buffers "
                            "and a process group).")
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def staged_bytes(self) -> int:
        """Host bytes of the last save's staged copy on this rank (its share of the model and optimizer state)."""
        return self._stager.staged_bytes if self._stager is not None else 0

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._pending is not None

    def save(self, checkpoint: dict[str, Any], path: str, is_global_zero: bool, device: torch.device,
             checksums: bool = True) -> None:
        """Stage ``checkpoint`` (Lightning's dict; ``device``: where its tensors live) and write it to ``path`` in the
        background. Waits for the previous save first (raising its error)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        group = self._save_group()
        tmp = _begin_save(Path(path), is_global_zero, group)
        state = _dcp_state(checkpoint)
        meta = _meta_bytes(checkpoint) if is_global_zero else None
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")  # every rank's own random streams, as they are now
        if self._stager is None:
            self._stager = _HostStager(device)
        upload = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, async_stager=self._stager)
        del state  # DCP holds the staged copy; the live tensors are the training's again
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_4d-checkpoint")
        with self._lock:
            self._after, self._succeeded = [], None
        self._reported = False
        self._pending = self._executor.submit(self._finish, upload, tmp, Path(path), meta, is_global_zero, checksums,
                                              group)

    def _save_group(self) -> Optional[dist.ProcessGroup]:
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)  # collective: every rank saves
        return self._group

    def _finish(self, upload: Future, tmp: Path, final: Path, meta: Optional[bytes], is_global_zero: bool,
                checksums: bool, group: Optional[dist.ProcessGroup]) -> None:
        """The background thread: wait for DCP's write, then hash, write the manifest and swap (every rank)."""
        failure = None
        try:
            upload.result()
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
            failure = f"the shards could not be written: {_first_line(err)}"
        try:
            _finish_save(tmp, final, meta, is_global_zero, checksums, group, failure)
        except BaseException:
            with self._lock:
                dropped, self._after, self._succeeded = self._after or [], None, False
            _warn_kept(len(dropped), final)
            raise
        with self._lock:
            todo, self._after, self._succeeded = self._after or [], None, True
        for fn in todo:
            try:
                fn()
            except Exception as err:  # the checkpoint is complete: a removal that failed is only reported
                log.warning("lightning_4d: after the save of %s: %s: %s", final, type(err).__name__, err)

    def after_save(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (e.g. removing an older checkpoint) once the save in flight is complete, or now if none is; if
        that save fails, ``fn`` is not run (the older checkpoint stays)."""
        with self._lock:
            if self._after is not None:
                self._after.append(fn)
                return
            failed = self._succeeded is False
        if failed:
            _warn_kept(1, None)
        else:
            fn()

    def poll(self) -> None:
        """Log (once, on this rank) a background save that has failed; cheap, no collective, no wait. The error is
        raised on every rank by the next :meth:`wait` (the next save, a load, preemption or teardown)."""
        pending = self._pending
        if pending is None or self._reported or not pending.done() or pending.exception() is None:
            return
        self._reported = True
        log.error("lightning_4d: a background checkpoint save failed (raised at the next save or at the end of "
                  "training): %s", _first_line(pending.exception()))

    def wait(self) -> None:
        """Block until the save in flight is complete; raise its error (the same on every rank)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        finally:
            with self._lock:
                self._succeeded = None  # from now on a removal runs at once

    def close(self) -> Optional[BaseException]:
        """Wait for the save in flight, free the staging buffers and the thread; return the save's error, if any."""
        error: Optional[BaseException] = None
        try:
            self.wait()
        except BaseException as err:  # returned: the caller decides whether it masks another error
            error = err
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return error


def _warn_kept(count: int, final: Optional[Path]) -> None:
    if count:
        log.warning("lightning_4d: %d checkpoint removal(s) asked for during the failed save%s not done: the older "
                    "checkpoints are kept.", count, f" of {final}" if final is not None else "")


def _host_bytes(tree: Any) -> int:
    """Bytes of the distinct storages of the (local) tensors in a nested dict / list (a staged state dict)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if isinstance(item, DTensor) else item
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
