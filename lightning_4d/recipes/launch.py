"""Running a recipe: :func:`run` (data, model, strategy, Trainer, fit) and what it returns (:class:`RunResult`),
with the launch environment Lightning's launcher needs to re-run this job in its ranks.

Example:
    >>> RunResult(losses=[3.0, 2.5]).loss_drop
    0.5
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from omegaconf import OmegaConf

from lightning_4d.recipes.resources import ResourceReport, check_resources
from lightning_4d.recipes.resume import RESUME_ENV, resume_checkpoint

from lightning_4d.recipes.build import _RUN_DIR_ENV, build_data, build_model, build_trainer, output_dir
from lightning_4d.recipes.preflight import Config, _print, validate

if TYPE_CHECKING:
    import lightning as L

__all__ = ["ALLOC_CONF_ENV", "RunResult", "apply_cuda_alloc_conf", "run"]


@dataclass
class RunResult:
    """What :func:`run` returns (picklable): per-step global losses, where things were written, the
    resource report and the last logged metrics.

    Example:
        >>> RunResult(losses=[2.0, 1.0]).loss_drop
        1.0
    """

    losses: list[float] = field(default_factory=list)
    output_dir: str = ""
    log_dir: Optional[str] = None
    checkpoint: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict)
    summary: str = ""

    @property
    def loss_drop(self) -> float:
        """First minus last recorded training loss (``nan`` with fewer than two steps)."""
        return self.losses[0] - self.losses[-1] if len(self.losses) >= 2 else float("nan")


def _hydra_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", _RUN_DIR_ENV, RESUME_ENV)


def _prepare_subprocess_launch(root: Path, ckpt: Optional[Path]) -> Optional[dict[str, Optional[str]]]:
    """Make ranks started by Lightning's launcher (which re-runs ``sys.argv``) run *this* job (its directory and
    the checkpoint it resumes from).

    Returns the launch-related environment to restore after the job (``None`` in a launched rank,
    under torchrun or SLURM, where there is nothing to launch).
    """
    if "LOCAL_RANK" in os.environ:
        return None
    saved = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    os.environ[_RUN_DIR_ENV] = str(root)
    os.environ[RESUME_ENV] = str(ckpt) if ckpt is not None else ""
    if _hydra_multirun():
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import read_write

        # Without this every launched rank would run the whole sweep; give it this job's overrides.
        hc = HydraConfig.get()
        sys.argv = [sys.argv[0], *hc.overrides.task]
        # The launcher passes hydra.run.dir to the ranks: make it this job's directory (not a new one).
        with read_write(hc):
            hc.run.dir = hc.runtime.output_dir
    return saved


def _finish_launch(saved: Optional[dict[str, Optional[str]]]) -> None:
    """Undo what launching did (process group, ``LOCAL_RANK``, ``MASTER_PORT``, ...) so that the next
    run in this process (the next job of a multirun) launches its own ranks on a fresh port."""
    if saved is None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either; the first is set


def apply_cuda_alloc_conf(value: Optional[str]) -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=value`` (``trainer.cuda_alloc_conf``; ``gpu.yaml``: ``expandable_segments:True``)
    where the environment sets neither allocator variable. CUDA's caching allocator reads it once, when CUDA
    initialises: :func:`run` calls this first, before anything touches a GPU, and the ranks Lightning's launcher
    starts inherit it. A value that comes too late (CUDA already initialised) is refused with a warning.

    Example:
        >>> apply_cuda_alloc_conf(None)  # nothing to set
    """
    if not value or any(name in os.environ for name in ALLOC_CONF_ENV):
        return
    import torch

    if torch.cuda.is_initialized():
        warnings.warn(f"trainer.cuda_alloc_conf={value!r} is ignored: CUDA was initialised before the recipe ran, and "
                      f"its allocator reads {ALLOC_CONF_ENV[0]} only then. Set it in the environment instead.",
                      stacklevel=2)
        return
    os.environ[ALLOC_CONF_ENV[0]] = value


def run(cfg: Config, callbacks: Sequence[L.Callback] = ()) -> RunResult:
    """Validate, check resources (fail fast), then build data, Trainer and model, and train.

    Order matters: nothing is built, downloaded or allocated before the resource check passes.
    ``callbacks``: extra Lightning callbacks for this run (when calling ``run`` from Python). ``resume``
    (default ``auto``) continues from the newest checkpoint of the run directory (:mod:`~lightning_4d.recipes.resume`).

    Example:
        >>> # not run: needs a Trainer (and the recipe's config files)
        >>> result = run(cfg)  # doctest: +SKIP
        >>> result.losses[0] > result.losses[-1]  # doctest: +SKIP
        True
    """
    import lightning as L

    from lightning_4d.recipes.observe import check_logger

    c = validate(cfg)
    apply_cuda_alloc_conf(c.trainer.cuda_alloc_conf)  # before anything initialises CUDA
    check_logger(c.logger.name)  # a logger whose package is missing fails before anything is built
    report: Optional[ResourceReport] = check_resources(c) if c.check_resources else None
    root = output_dir(c)
    ckpt = resume_checkpoint(c.resume, root)
    saved_env = _prepare_subprocess_launch(root, ckpt)
    try:
        if report is not None:
            _print(report.describe())
        L.seed_everything(c.seed, workers=True, verbose=False)
        data = build_data(c)
        trainer = build_trainer(c, root, callbacks)
        model = build_model(c, trainer)
        if trainer.logger is not None:
            hp = OmegaConf.to_container(OmegaConf.structured(c), resolve=True)
            for lg in trainer.loggers:
                lg.log_hyperparams({"recipe": hp})
        trainer.fit(model, datamodule=data, ckpt_path=str(ckpt) if ckpt is not None else None)
        log_dir = trainer.log_dir  # a broadcast: every rank calls it
        trainer.strategy.barrier("recipe_end")  # no rank tears down while another still communicates
    finally:
        _finish_launch(saved_env)
    history = next(cb for cb in trainer.callbacks if type(cb).__name__ == "_LossHistory")
    ckpt = next((cb for cb in trainer.callbacks if type(cb).__name__ == "ModelCheckpoint"), None)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    result = RunResult(
        losses=list(history.losses), output_dir=str(root), log_dir=log_dir,
        checkpoint=(ckpt.last_model_path or ckpt.best_model_path or None) if ckpt is not None else None,
        metrics=metrics, summary=report.describe() if report is not None else "")
    if result.losses:
        _print(f"train_loss: {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over {len(result.losses)} steps; "
               f"logs in {result.log_dir or root}")
    return result
