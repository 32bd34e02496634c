"""Resume by re-running: a recipe command run again in the same run directory continues where it stopped.

``resume`` (``conf/train.yaml``) chooses what ``trainer.fit`` starts from:

- ``auto`` (default; ``true`` too): the newest complete checkpoint in ``<run dir>/checkpoints`` — saves of
  ``ModelCheckpoint`` and of preemption (``preempted-step=N.ckpt``) alike, the highest global step winning, ties
  by completion time, incomplete or damaged ones skipped (:func:`~lightning_4d.checkpoint.find_checkpoints`) —
  else step 0. The strategy restores the loop position and the data order, so the losses are those of an
  uninterrupted run.
- ``false``: start over (the checkpoints are left where they are).
- a path: that checkpoint (a directory written by ``FourDStrategy``).

The run directory must be the same at each run: ``output_dir=DIR``, ``hydra.run.dir=DIR``, or — under SLURM —
the default, ``outputs/slurm-<SLURM_JOB_ID>`` (:func:`run_name`: a requeued job keeps its id), instead of
``outputs/<date>/<time>``. Rank 0 prints one line saying what the run starts from.

Example:
    >>> resume_mode("auto"), resume_mode("False"), resume_mode("ckpts/step=4.ckpt")
    ('auto', 'false', 'path')
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lightning_4d.recipes.schema import RecipeConfigError, register_resolvers, resume_mode, run_name

__all__ = ["RESUME_ENV", "checkpoint_dir", "register_resolvers", "resume_checkpoint", "resume_mode", "run_name"]

#: Set by the process that launches the ranks: the checkpoint it chose ("" for none), so that every rank agrees.
RESUME_ENV = "LIGHTNING_4D_RESUME"


def checkpoint_dir(root: Path) -> Path:
    """Where a recipe's checkpoints go (``ModelCheckpoint`` and preemption saves): ``<run dir>/checkpoints``.

    Example:
        >>> checkpoint_dir(Path("/tmp/run")).as_posix()
        '/tmp/run/checkpoints'
    """
    return root / "checkpoints"


def _say(msg: str) -> None:
    """Print on global rank 0 only (the launching process, torchrun's rank 0 or SLURM's task 0)."""
    if all(os.environ.get(k, "0") == "0" for k in ("LOCAL_RANK", "RANK", "SLURM_PROCID")):
        print(msg, flush=True)


def resume_checkpoint(value: str, root: Path) -> Optional[Path]:
    """The checkpoint a run in ``root`` resumes from for ``resume=value`` (``None``: step 0), said in one line.

    Ranks started by Lightning's launcher take the launching process's choice (:data:`RESUME_ENV`), so that every
    rank loads the same checkpoint; under torchrun or SLURM each rank finds the same one in the same files.

    Raises:
        RecipeConfigError: ``value`` is a path that is not a complete checkpoint.

    Example:
        >>> resume_checkpoint("false", Path("/tmp/nowhere")) is None
        resume=false: training from step 0 (checkpoints in /tmp/nowhere/checkpoints are not read)
        True
    """
    from lightning_4d.checkpoint import check_checkpoint, find_checkpoints

    if "LOCAL_RANK" in os.environ and RESUME_ENV in os.environ:
        chosen = os.environ[RESUME_ENV]
        return Path(chosen) if chosen else None
    mode, directory = resume_mode(value), checkpoint_dir(root)
    if mode == "false":
        _say(f"resume=false: training from step 0 (checkpoints in {directory} are not read)")
        return None
    if mode == "path":
        path = Path(value).absolute()
        try:
            check_checkpoint(path)
        except (FileNotFoundError, ValueError) as err:
            raise RecipeConfigError(f"resume={value!r}: {err} Pass a checkpoint directory written by FourDStrategy, "
                                    f"resume=auto (the newest in {directory}) or resume=false.") from None
        _say(f"resume={value}: resuming from {path}")
        return path
    found, skipped = find_checkpoints(directory)
    for line in skipped:
        _say(f"resume=auto: skipping {line}")
    if not found:
        _say(f"resume=auto: no checkpoint in {directory}: training from step 0")
        return None
    newest = found[-1]
    _say(f"resume=auto: resuming from {newest.path} (global step {newest.step}, the newest of {len(found)} complete "
         f"checkpoint(s) in {directory}; resume=false starts over)")
    return newest.path


