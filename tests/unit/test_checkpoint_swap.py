"""Crash-safe checkpoint swaps: a save interrupted at every file operation leaves a complete checkpoint.

One process, no process group: ``save_sharded`` / ``load_sharded`` work without one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_4d.checkpoint import state as ckpt_state
from lightning_4d.checkpoint.state import (check_checkpoint, is_checkpoint, load_sharded, model_state_dict,
                                           optimizer_state_dict, recover_checkpoint, save_sharded)


class _Crash(Exception):
    pass


def _model(value: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # one step fills the state; lr 0 keeps `value`
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(path: Path, value: float) -> None:
    model, opt = _model(value)
    ckpt = {"state_dict": model_state_dict(model), "optimizer_states": [optimizer_state_dict(model, opt)],
            "global_step": int(value)}
    save_sharded(ckpt, str(path), is_global_zero=True)


def _load(path: Path) -> float:
    """Load into a fresh model; return the (uniform) weight value, checking the loop state matches it."""
    model, opt = _model(-1.0)
    meta = load_sharded(str(path), model, [opt])
    values = {float(v) for p in model.parameters() for v in p.detach().flatten()}
    assert len(values) == 1, values
    value = values.pop()
    assert meta["global_step"] == int(value)
    return value


def _count_ops(monkeypatch: pytest.MonkeyPatch, crash_at: int | None) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    real = ckpt_state._file_op

    def op(kind: str, fn: Any, *args: Any) -> Any:
        seen.append((kind, Path(args[0]).name))
        if crash_at is not None and len(seen) - 1 == crash_at:
            raise _Crash(f"crash at {kind} {args[0]}")
        return real(kind, fn, *args)

    monkeypatch.setattr(ckpt_state, "_file_op", op)
    return seen


def _leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


# A save onto an existing checkpoint, with and without the leftovers of earlier interrupted saves.
STARTS = ["clean", "stale-partial", "stale-old", "half-removed-old"]


def _prepare(tmp: Path, start: str) -> Path:
    path = tmp / "last.ckpt"
    _save(path, 1.0)
    if start == "stale-partial":
        (tmp / "last.ckpt.partial").mkdir()
        (tmp / "last.ckpt.partial" / "__0_0.distcp").write_bytes(b"half")
    elif start == "stale-old":
        shutil.copytree(path, tmp / "last.ckpt.old")
    elif start == "half-removed-old":
        shutil.copytree(path, tmp / "last.ckpt.old")
        (tmp / "last.ckpt.old" / ".complete").unlink()
        (tmp / "last.ckpt.old" / "meta.pt").unlink()
    return path


@pytest.mark.parametrize("start", STARTS)
def test_crash_at_every_file_operation(start: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # How many file operations a save makes from this start.
    probe = tmp_path / "probe"
    probe.mkdir()
    _prepare(probe, start)
    ops = _count_ops(monkeypatch, None)
    _save(probe / "last.ckpt", 2.0)
    n = len(ops)
    kinds = {kind for kind, _ in ops}
    assert {"mkdir", "write", "replace", "rmtree"} <= kinds and n >= 7, ops
    monkeypatch.undo()
    for k in range(n):
        case = tmp_path / f"crash{k}"
        case.mkdir()
        path = _prepare(case, start)
        _count_ops(monkeypatch, k)
        with pytest.raises(_Crash):
            _save(path, 2.0)
        monkeypatch.undo()
        # The crash may sit between the two renames: a load recovers the newest complete directory.
        got = _load(path)
        assert got in (1.0, 2.0), (k, ops[k])
        if k >= n - 2:  # crashed after the new directory was in place (removing the previous one)
            assert got == 2.0, (k, ops[k])
        assert is_checkpoint(path), (k, ops[k])
        # The next save always succeeds and leaves nothing beside the checkpoint.
        _save(path, 3.0)
        assert _load(path) == 3.0 and _leftovers(path) == [], (k, ops[k], _leftovers(path))


def test_crash_between_renames_recovered_by_save_and_named_by_check(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    real = ckpt_state._file_op

    def op(kind: str, fn: Any, *args: Any) -> Any:
        if kind == "replace" and Path(args[0]).name.endswith(".partial"):
            raise _Crash("killed between the two renames")
        return real(kind, fn, *args)

    monkeypatch.setattr(ckpt_state, "_file_op", op)
    with pytest.raises(_Crash):
        _save(path, 2.0)
    monkeypatch.undo()
    assert not path.exists() and is_checkpoint(tmp_path / "last.ckpt.partial") and is_checkpoint(
        tmp_path / "last.ckpt.old")
    # Export / check_checkpoint do not move anything but name the complete sibling.
    with pytest.raises(FileNotFoundError, match=r"last\.ckpt\.partial holds a complete checkpoint"):
        check_checkpoint(path)
    # The next save puts the newest complete checkpoint back first, then replaces it.
    _save(path, 3.0)
    assert _load(path) == 3.0 and _leftovers(path) == []


def test_recover_prefers_the_new_checkpoint_and_ignores_incomplete(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    _save(path, 1.0)
    os.replace(path, tmp_path / "c.ckpt.old")
    _save(tmp_path / "n.ckpt", 2.0)
    os.replace(tmp_path / "n.ckpt", tmp_path / "c.ckpt.partial")
    assert recover_checkpoint(path) == tmp_path / "c.ckpt.partial"
    assert _load(path) == 2.0 and _leftovers(path) == []
    # Only an incomplete `.partial` (no marker): nothing is recovered, the error says there is no checkpoint.
    other = tmp_path / "d.ckpt"
    (tmp_path / "d.ckpt.partial").mkdir()
    assert recover_checkpoint(other) is None
    with pytest.raises(FileNotFoundError, match="no such directory"):
        check_checkpoint(other)


def test_damaged_meta_without_checksums_and_manifest_damage(tmp_path: Path) -> None:
    from lightning_4d.checkpoint.state import CheckpointIntegrityError, verify_checkpoint

    path = tmp_path / "s.ckpt"
    model, opt = _model(1.0)
    save_sharded({"state_dict": model_state_dict(model), "optimizer_states": [optimizer_state_dict(model, opt)],
                  "global_step": 1}, str(path), is_global_zero=True, checksums=False)
    assert verify_checkpoint(path, checksums=True) >= 3  # sizes only were recorded: sizes are checked
    meta = path / "meta.pt"
    data = bytearray(meta.read_bytes())
    data[data.index(b"global_step")] ^= 0xFF  # a key becomes invalid UTF-8 (a raw UnicodeDecodeError before)
    meta.write_bytes(bytes(data))
    # Sizes still match: the damage surfaces when meta.pt is read, named, not as a raw decoding error.
    with pytest.raises(CheckpointIntegrityError, match=r"s\.ckpt/meta\.pt is damaged: it cannot be read"):
        _load(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointIntegrityError, match=r"manifest\.json is damaged"):
        verify_checkpoint(path)


def test_strategy_options_are_validated() -> None:
    from lightning_4d import FourDStrategy

    with pytest.raises(ValueError, match="nonfinite='ignore' must be one of 'raise', 'skip', 'off'"):
        FourDStrategy(nonfinite="ignore")
    assert FourDStrategy().skipped_steps == 0


def test_shape_mismatch_error_quotes_the_cause(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    _save(path, 1.0)
    other = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))  # same names, other sizes
    with pytest.raises(ValueError) as info:
        load_sharded(str(path), other, [])
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"Could not load {path}: it does not match Sequential: 3 parameter(s) have other shapes"), first
    assert "0.weight: saved (3, 4), model (5, 4)" in first and "1.weight: saved (2, 3), model (2, 5)" in first, first
    assert "Traceback" not in first and "File " not in first, first
