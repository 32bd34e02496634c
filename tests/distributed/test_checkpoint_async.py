"""``FourDStrategy(async_checkpoint=True)`` in real worlds: checkpoints equal to synchronous ones, written while the
training goes on; an exact resume; two saves back to back; preemption during a save in flight; background errors
raised on every rank; a rank killed during the background write leaves the previous checkpoint loadable.

Each rank holds DCP's background writes (:class:`_HeldWrites`) until the training has finished a step after the save
(so a save that blocked the training would never finish) or until something waits for the save.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch

from lightning_4d.testing import run_world

SAVE_EVERY = 2
STEPS = 2 * SAVE_EVERY  # two saves


class _HeldWrites(L.Callback):
    """DCP's background write of each save waits until the training has ended a step after the save (``"step"``)
    or the strategy waits for the save (``"wait"``); :attr:`opened_by` records which, per save. ``on_step=False``:
    only a wait releases a write. ``fail_rank`` raises a full disk in the write there; ``kill_rank`` exits that rank
    (``os._exit``) in its second save's write, released by the training going on."""

    def __init__(self, on_step: bool = True, fail_rank: Optional[int] = None, kill_rank: Optional[int] = None) -> None:
        self.on_step, self.fail_rank, self.kill_rank = on_step, fail_rank, kill_rank
        self._release: dict[str, threading.Event] = {}  # per save (its `.partial` directory), in order
        self._why: dict[str, str] = {}
        self.staged: list[tuple[int, int]] = []  # (staged bytes, this rank's share of the state) per save
        self.groups: set[tuple[str, bool, int]] = set()  # (backend, not the default group, size) of the saves' group
        self._undo: list[tuple[Any, str, Any]] = []

    @property
    def opened_by(self) -> list[str]:
        return [self._why.get(key, "never") for key in self._release]

    def _open(self, why: str) -> None:
        for key, event in self._release.items():
            if not event.is_set():
                self._why[key] = why
                event.set()

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        from lightning_4d.checkpoint.background import BackgroundSaver

        gate, rank = self, trainer.global_rank
        real_write, real_save, real_wait = FileSystemWriter.write_data, BackgroundSaver.save, BackgroundSaver.wait

        def write_data(writer: Any, plan: Any, planner: Any) -> Any:
            key = str(writer.path)
            assert gate._release[key].wait(120), "a background write was never released"
            if rank == gate.fail_rank:
                raise OSError(28, "No space left on device")
            if rank == gate.kill_rank and list(gate._release).index(key) == 1 and gate._why[key] == "step":
                os._exit(1)  # killed while writing, the training already past the save
            return real_write(writer, plan, planner)

        def save(saver: Any, checkpoint: Any, path: str, *args: Any, **kwargs: Any) -> None:
            saver.wait()  # the previous save first (released by this wait), then this one is held
            gate._release[str(Path(f"{path}.partial"))] = threading.Event()
            real_save(saver, checkpoint, path, *args, **kwargs)
            gate.staged.append((saver.staged_bytes, _share(trainer.optimizers[0])))
            group = saver._group  # the background collectives' own host group, not the training's
            gate.groups.add((dist.get_backend(group), group is not dist.group.WORLD, dist.get_world_size(group)))

        def wait(saver: Any) -> None:
            if saver.in_flight:
                gate._open("wait")
            real_wait(saver)

        for owner, name, fn in ((FileSystemWriter, "write_data", write_data), (BackgroundSaver, "save", save),
                                (BackgroundSaver, "wait", wait)):
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, fn)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.on_step:
            self._open("step")

    def _restore(self) -> None:
        while self._undo:
            owner, name, fn = self._undo.pop()
            setattr(owner, name, fn)

    def teardown(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._restore()  # after a failed fit Lightning calls no callback's teardown


def _share(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's shards of the parameters and of their optimizer state."""
    from lightning_4d.core.distributed import local_of

    params = [p for group in optimizer.param_groups for p in group["params"]]
    tensors = params + [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return sum(local_of(t).numel() * t.element_size() for t in tensors)


class _SaveTwice(L.Callback):
    """At the end of step ``SAVE_EVERY``: two saves back to back."""

    def __init__(self, root: str) -> None:
        self.root = root

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == SAVE_EVERY:
            trainer.save_checkpoint(f"{self.root}/x.ckpt")
            trainer.save_checkpoint(f"{self.root}/y.ckpt")


class _Preempt(L.Callback):
    """Rank 0 gets SIGTERM during step ``SAVE_EVERY + 1``, while the save after step ``SAVE_EVERY`` is held; records
    what was complete when the preemption ended the fit."""

    def __init__(self, root: str) -> None:
        self.root, self.complete = root, {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == SAVE_EVERY and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        from lightning_4d.checkpoint import is_checkpoint

        names = (f"step={SAVE_EVERY}.ckpt", f"preempted-step={SAVE_EVERY + 1}.ckpt")
        self.complete = {n: is_checkpoint(f"{self.root}/{n}") for n in names}


def _error_of(fn: Any) -> str:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - Preempted is a SystemExit; the message is what is checked
        return f"{type(err).__name__}: {err}"
    return ""


def _async_world(rank: int, tmp: str) -> dict[str, Any]:
    from tests.distributed.ckpt_common import train

    on = dict(async_checkpoint=True)
    out: dict[str, Any] = {}
    out["sync"] = train(dict(), 2, STEPS, every_n=SAVE_EVERY, ckpt_dir=f"{tmp}/sync")
    held = _HeldWrites()
    out["async"] = train(on, 2, STEPS, every_n=SAVE_EVERY, ckpt_dir=f"{tmp}/async", extra_callbacks=[held])
    out["async_opened_by"], out["staged"], out["groups"] = held.opened_by, held.staged, held.groups
    out["resumed"] = out["async"][:SAVE_EVERY] + train(on, 2, STEPS, ckpt_in=f"{tmp}/async/step={SAVE_EVERY}.ckpt")
    held = _HeldWrites()
    train(on, 2, SAVE_EVERY + 1, extra_callbacks=[held, _SaveTwice(f"{tmp}/twice")])
    out["twice_opened_by"] = held.opened_by
    held, preempt = _HeldWrites(on_step=False), _Preempt(f"{tmp}/pre")
    out["preempted"] = _error_of(lambda: train(on, 2, STEPS, every_n=SAVE_EVERY, ckpt_dir=f"{tmp}/pre",
                                               extra_callbacks=[held, preempt]))
    out["preempt_opened_by"], out["preempt_complete"] = held.opened_by, preempt.complete
    # A full disk on rank 1: raised on every rank by the next save, or (the last save) at the end of fit.
    out["next_save"] = _error_of(lambda: train(on, 2, STEPS, every_n=SAVE_EVERY, ckpt_dir=f"{tmp}/err1",
                                               extra_callbacks=[_HeldWrites(fail_rank=1)]))
    out["teardown"] = _error_of(lambda: train(on, 2, SAVE_EVERY, every_n=SAVE_EVERY, ckpt_dir=f"{tmp}/err2",
                                              extra_callbacks=[_HeldWrites(fail_rank=1)]))
    return out


def _killed_world(rank: int, tmp: str) -> None:
    from tests.distributed.ckpt_common import train

    # save_top_k=1: ModelCheckpoint asks to remove step=2 as soon as the save of step=4 has started.
    train(dict(async_checkpoint=True), 2, STEPS + 1, every_n=SAVE_EVERY, ckpt_dir=f"{tmp}/kill", top_k=1,
          extra_callbacks=[_HeldWrites(kill_rank=1)])


def _dcp_contents(path: Path, scratch: Path) -> dict[str, Any]:
    """Every tensor and value DCP wrote (the whole model and optimizer state), read in one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, where


def _assert_same_checkpoint(a: Path, b: Path, scratch: Path) -> None:
    """Bit-identical model and optimizer state, random states and loop state (the callbacks' state names its
    directory)."""
    _assert_same(_dcp_contents(a, scratch), _dcp_contents(b, scratch), a.name)
    for rank in (0, 1):
        _assert_same(torch.load(a / f"rng_rank{rank}.pt", weights_only=False)["torch"],
                     torch.load(b / f"rng_rank{rank}.pt", weights_only=False)["torch"], f"rng {rank}")
    meta_a, meta_b = (torch.load(p / "meta.pt", weights_only=False) for p in (a, b))
    meta_a.pop("callbacks"), meta_b.pop("callbacks")
    _assert_same(meta_a, meta_b, "meta")


def test_async_checkpoints_equal_sync_resume_exactly_and_survive_faults(tmp_path: Path) -> None:
    from lightning_4d.checkpoint import check_checkpoint, latest_checkpoint, verify_checkpoint

    results = run_world(_async_world, 2, str(tmp_path), pg_timeout_s=60)
    steps = [f"step={s}.ckpt" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)]
    for r in results:
        # Saving in the background changes nothing in the training; a resumed run continues exactly.
        assert r["async"] == r["sync"] and r["resumed"] == r["sync"]
        # The training went on while each save was written (the last one: the end of fit waited for it).
        assert r["async_opened_by"] == ["step", "wait"], r["async_opened_by"]
        # One host copy of the rank's own shards of the parameters and optimizer state per save (FSDP2 dp=2: half).
        assert len(r["staged"]) == 2 and all(staged == share for staged, share in r["staged"]), r["staged"]
        assert r["groups"] == {("gloo", True, 2)}, r["groups"]
        # The second of two back-to-back saves waited for the first, still being written.
        assert r["twice_opened_by"] == ["wait", "step"], r["twice_opened_by"]
        # Preemption waited for the save in flight, then saved and waited for its own save.
        assert r["preempted"].startswith(f"Preempted: preempted by SIGTERM: checkpoint saved to {tmp_path}/pre/"
                                         f"preempted-step={SAVE_EVERY + 1}.ckpt"), r["preempted"]
        assert r["preempt_opened_by"] == ["wait", "wait"] and all(r["preempt_complete"].values()), r
        for case in ("next_save", "teardown"):
            where = tmp_path / ("err1" if case == "next_save" else "err2") / f"step={SAVE_EVERY}.ckpt"
            assert r[case].startswith(f"CheckpointSaveError: Could not save {where}: the shards could not be "
                                      f"written: "), (case, r[case])
            assert "No space left on device (rank 1)" in r[case], (case, r[case])
    for name in steps:
        verify_checkpoint(tmp_path / "async" / name)
        _assert_same_checkpoint(tmp_path / "async" / name, tmp_path / "sync" / name, tmp_path)
    _assert_same_checkpoint(tmp_path / "twice" / "x.ckpt", tmp_path / "twice" / "y.ckpt", tmp_path)
    verify_checkpoint(tmp_path / "pre" / f"preempted-step={SAVE_EVERY + 1}.ckpt")
    assert latest_checkpoint(tmp_path / "err1") is None and latest_checkpoint(tmp_path / "err2") is None

    # A rank killed during the background write of step=4 (the training past it): the previous checkpoint, which
    # ModelCheckpoint(save_top_k=1) had asked to remove, is still there, intact, and loads.
    killed = run_world(_killed_world, 2, str(tmp_path), raise_on_error=False, pg_timeout_s=20)
    assert not killed[0]["ok"] and killed[1]["error"] == "rank 1 produced no result (exit code 1)", killed
    kill = tmp_path / "kill"
    assert latest_checkpoint(kill) == kill / steps[0], sorted(p.name for p in kill.iterdir())
    verify_checkpoint(kill / steps[0])
    _assert_same_checkpoint(kill / steps[0], tmp_path / "sync" / steps[0], tmp_path)
    with pytest.raises(ValueError, match="interrupted save"):
        check_checkpoint(kill / f"{steps[1]}.partial")
