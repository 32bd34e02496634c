"""Background (asynchronous) checkpoint saves in one process: the same files as a synchronous save, the staged copy
saved while the training changes the weights, crash safety at every file operation, one save at a time, errors
raised at the next wait, removals only after the save in flight is complete."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from lightning_4d.checkpoint import background as bg
from lightning_4d.checkpoint.background import BackgroundSaver
from lightning_4d.checkpoint.state import (CheckpointSaveError, is_checkpoint, load_sharded, model_state_dict,
                                           optimizer_state_dict, save_sharded)
from tests.unit.test_checkpoint_swap import _Crash, _count_ops, _leftovers, _load, _model, _prepare

CPU = torch.device("cpu")


def _checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"state_dict": model_state_dict(model), "optimizer_states": [optimizer_state_dict(model, opt)],
            "global_step": step}


def _save_async(path: Path, value: float) -> None:
    saver = BackgroundSaver()
    model, opt = _model(value)
    try:
        saver.save(_checkpoint(model, opt, int(value)), str(path), is_global_zero=True, device=CPU)
        saver.wait()  # raises the background thread's error
    finally:
        saver.close()


@pytest.fixture
def held_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """DCP's background write waits for ``release`` (set by the test); ``writing`` is set when it has begun."""
    writing, release = threading.Event(), threading.Event()
    real = FileSystemWriter.write_data

    def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        writing.set()
        assert release.wait(60), "the test never released the write"
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    yield writing, release
    release.set()


def _state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    model, opt = _model(-1.0)
    meta = load_sharded(str(path), model, [opt])
    return model.state_dict(), opt.state_dict(), meta


def test_async_equals_sync_and_saves_the_staged_copy(tmp_path: Path, held_writes: Any) -> None:
    writing, release = held_writes
    model, opt = _model(1.0)
    release.set()
    save_sharded(_checkpoint(model, opt, 1), str(tmp_path / "sync.ckpt"), is_global_zero=True)
    release.clear()
    writing.clear()
    saver = BackgroundSaver()
    saver.save(_checkpoint(model, opt, 1), str(tmp_path / "async.ckpt"), is_global_zero=True, device=CPU)
    assert writing.wait(60) and saver.in_flight and not is_checkpoint(tmp_path / "async.ckpt")
    with torch.no_grad():  # the training goes on while the files are written: the save holds the staged copy
        for p in model.parameters():
            p.fill_(5.0)
        for state in opt.state.values():
            state["exp_avg"].fill_(7.0)
    release.set()
    saver.wait()
    assert not saver.in_flight and is_checkpoint(tmp_path / "async.ckpt")
    (m_sync, o_sync, meta_sync), (m_async, o_async, meta_async) = (_state(tmp_path / n) for n in ("sync.ckpt",
                                                                                                  "async.ckpt"))
    assert meta_sync == meta_async == {"global_step": 1}
    for name, value in m_sync.items():
        assert torch.equal(value, m_async[name]) and float(value.flatten()[0]) == 1.0, name
    for i, state in o_sync["state"].items():
        for key, value in state.items():
            assert torch.equal(value, o_async["state"][i][key]), (i, key)
    assert torch.equal(torch.load(tmp_path / "sync.ckpt" / "rng_rank0.pt", weights_only=False)["torch"],
                       torch.load(tmp_path / "async.ckpt" / "rng_rank0.pt", weights_only=False)["torch"])
    assert saver.close() is None


def test_crash_at_every_file_operation_of_a_background_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    _prepare(probe, "stale-partial")
    ops = _count_ops(monkeypatch, None)
    _save_async(probe / "last.ckpt", 2.0)
    n = len(ops)
    assert {"mkdir", "write", "replace", "rmtree"} <= {kind for kind, _ in ops} and n >= 7, ops
    monkeypatch.undo()
    for k in range(n):
        case = tmp_path / f"crash{k}"
        case.mkdir()
        path = _prepare(case, "stale-partial")
        _count_ops(monkeypatch, k)
        with pytest.raises(_Crash):  # raised in the background thread, surfaced by the wait
            _save_async(path, 2.0)
        monkeypatch.undo()
        got = _load(path)
        assert got in (1.0, 2.0) and (got == 2.0 or k < n - 2), (k, ops[k])  # the last two: removing the old one
        _save_async(path, 3.0)
        assert _load(path) == 3.0 and _leftovers(path) == [], (k, ops[k], _leftovers(path))


def test_a_second_save_waits_for_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_writes: Any) -> None:
    writing, release = held_writes
    events: list[str] = []
    for name in ("_begin_save", "_finish_save"):
        real = getattr(bg, name)

        def logged(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            events.append(f"{_name.strip('_').split('_')[0]} {Path(args[0]).name.split('.')[0]}")
            return _real(*args, **kwargs)

        monkeypatch.setattr(bg, name, logged)
    saver = BackgroundSaver()
    model, opt = _model(1.0)
    saver.save(_checkpoint(model, opt, 1), str(tmp_path / "a.ckpt"), is_global_zero=True, device=CPU)
    assert writing.wait(60)
    threading.Timer(0.2, release.set).start()  # the first write completes only after the second save has begun
    saver.save(_checkpoint(model, opt, 1), str(tmp_path / "b.ckpt"), is_global_zero=True, device=CPU)
    assert saver.close() is None
    assert events == ["begin a", "finish a", "begin b", "finish b"], events
    assert _load(tmp_path / "a.ckpt") == _load(tmp_path / "b.ckpt") == 1.0


def test_background_error_raises_at_the_next_save_and_keeps_older_checkpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    first = tmp_path / "step=1.ckpt"
    _save_async(first, 1.0)

    def full_disk(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    saver = BackgroundSaver()
    model, opt = _model(2.0)
    saver.save(_checkpoint(model, opt, 2), str(tmp_path / "step=2.ckpt"), is_global_zero=True, device=CPU)
    removed: list[str] = []
    saver.after_save(lambda: removed.append("step=1"))  # what ModelCheckpoint asks meanwhile: not done on failure
    saver._pending.exception(timeout=60)  # type: ignore[union-attr]  # the background save has failed by now
    with caplog.at_level(logging.ERROR, logger=bg.__name__):
        saver.poll()
        saver.poll()
    logged = [r.getMessage() for r in caplog.records if r.name == bg.__name__ and r.levelno == logging.ERROR]
    assert len(logged) == 1 and "No space left on device" in logged[0], logged  # logged once
    monkeypatch.undo()
    with pytest.raises(CheckpointSaveError, match=r"Could not save .*step=2\.ckpt: the shards could not be written: "
                                                  r"OSError: .*No space left on device \(rank 0\)\. It was not "
                                                  r"completed \(step=2\.ckpt\.partial is left incomplete\)"):
        saver.save(_checkpoint(model, opt, 3), str(tmp_path / "step=3.ckpt"), is_global_zero=True, device=CPU)
    assert removed == [] and _load(first) == 1.0 and not is_checkpoint(tmp_path / "step=2.ckpt")
    # A removal asked for while a save is in flight runs once that save is complete; with none in flight, at once.
    saver.save(_checkpoint(model, opt, 2), str(tmp_path / "step=2.ckpt"), is_global_zero=True, device=CPU)
    saver.after_save(lambda: removed.append(f"in flight: complete={is_checkpoint(tmp_path / 'step=2.ckpt')}"))
    assert saver.close() is None
    saver.after_save(lambda: removed.append("none in flight"))
    assert removed == ["in flight: complete=True", "none in flight"]


def test_a_strategy_with_async_checkpoints_pickles_until_it_saves(tmp_path: Path) -> None:
    import pickle

    from lightning_4d import FourDStrategy

    strategy = pickle.loads(pickle.dumps(FourDStrategy(async_checkpoint=True)))
    assert strategy.config.async_checkpoint and not strategy._saver.in_flight
    saver = BackgroundSaver()
    model, opt = _model(1.0)
    saver.save(_checkpoint(model, opt, 1), str(tmp_path / "a.ckpt"), is_global_zero=True, device=CPU)
    saver.wait()  # one host copy of what the rank holds: the parameters and the optimizer state
    assert saver.staged_bytes == sum(t.nbytes for t in [*model.parameters(),
                                                        *(v for s in opt.state.values() for v in s.values())])
    with pytest.raises(TypeError, match="has saved cannot be pickled"):
        pickle.dumps(saver)
    assert saver.close() is None
