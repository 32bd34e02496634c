"""The newest usable checkpoint of a directory: what a re-run (a requeued job) continues from.

``ModelCheckpoint`` saves (``epoch=0-step=40.ckpt``) and preemption saves (``preempted-step=57.ckpt``) are
compared by the global step each recorded (in its ``meta.pt``), ties broken by the time it was completed (its
``.complete`` marker). Incomplete saves are skipped: a ``.partial`` directory without its marker, a directory
without ``meta.pt`` / ``.metadata``, or one whose files do not match its manifest's sizes (a truncated copy). A
complete ``<path>.partial`` / ``<path>.old`` left by a crash between the two renames of a save counts as
``<path>`` (loading it moves it back, :func:`~lightning_4d.checkpoint.state.recover_checkpoint`). Only files are
read (sizes, one small ``meta.pt`` each; no checksums: loading verifies those), so every rank finds the same one.

Example:
    >>> latest_checkpoint("no/such/dir") is None
    True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightning_4d.checkpoint.state import _COMPLETE, _REQUIRED, META_FILE, _load_file, verify_checkpoint

__all__ = ["Found", "find_checkpoints", "latest_checkpoint"]

_SIBLING_SUFFIXES = (".partial", ".old")


@dataclass(frozen=True)
class Found:
    """A complete checkpoint of a directory.

    Attributes:
        path: the path to load (for a sibling left by an interrupted swap: the path it is moved back to).
        step: the global step it recorded.
        mtime: when it was completed (its ``.complete`` marker).
        stored: where it lies now (``path``, or its ``.partial`` / ``.old`` sibling).

    Example:
        >>> Found(Path("c/step=4.ckpt"), 4, 0.0).stored.as_posix()
        'c/step=4.ckpt'
    """

    path: Path
    step: int
    mtime: float
    stored: Path = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.stored is None:
            object.__setattr__(self, "stored", self.path)


def _inspect(stored: Path) -> tuple[Optional[int], str]:
    """(global step, "") of a complete, intact checkpoint directory, else (None, why it is skipped)."""
    missing = next((name for name in _REQUIRED if not (stored / name).exists()), None)
    if missing is not None:
        return None, f"{stored / missing} is missing (an interrupted save or a foreign directory)"
    try:
        verify_checkpoint(stored, checksums=False)  # sizes only: a truncated copy is skipped, not loaded
        step = _load_file(stored / META_FILE).get("global_step")
    except (ValueError, AttributeError) as err:  # CheckpointIntegrityError is a ValueError
        return None, str(err).splitlines()[0]
    if isinstance(step, bool) or not isinstance(step, int):
        return None, f"{stored / META_FILE} records no global step"
    return step, ""


def find_checkpoints(directory: str | os.PathLike) -> tuple[list[Found], list[str]]:
    """The complete checkpoints of ``directory``, oldest first (by step, then completion time, then name), and a
    line for each directory skipped (incomplete or damaged).

    Example:
        >>> find_checkpoints("no/such/dir")
        ([], [])
    """
    root = Path(directory)
    if not root.is_dir():
        return [], []
    found: list[Found] = []
    skipped: list[str] = []
    names = {p.name for p in root.iterdir()}
    for stored in sorted(p for p in root.iterdir() if p.is_dir()):
        final = stored
        for suffix in _SIBLING_SUFFIXES:
            if stored.name.endswith(suffix):
                final = stored.with_name(stored.name[: -len(suffix)])
        if final != stored and final.name in names:
            continue  # the checkpoint itself is there: the sibling is a leftover the next save removes
        step, why = _inspect(stored)
        if step is None:
            skipped.append(f"{stored.name}: {why}")
            continue
        found.append(Found(final, step, (stored / _COMPLETE).stat().st_mtime, stored))
    # a crash between the renames can leave both siblings complete: the newer (.partial) is the one moved back
    unique: dict[Path, Found] = {}
    for f in found:
        if f.path not in unique or f.stored.name.endswith(".partial"):
            unique[f.path] = f
    return sorted(unique.values(), key=lambda f: (f.step, f.mtime, f.path.name)), skipped


def latest_checkpoint(directory: str | os.PathLike) -> Optional[Path]:
    """The checkpoint of ``directory`` with the highest global step (ties: the most recently completed), or
    ``None``; incomplete or damaged ones are skipped (module docstring).

    Example:
        >>> # not run: needs files (checkpoints)
        >>> trainer.fit(model, ckpt_path=latest_checkpoint("outputs/run/checkpoints"))  # doctest: +SKIP
    """
    found, _ = find_checkpoints(directory)
    return found[-1].path if found else None

