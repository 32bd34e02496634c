"""Private Lightning APIs: process-group set-up, the launcher, LightningModule and loop internals.

Example:
    >>> from torch import nn
    >>> attached_trainer(nn.Linear(1, 1)) is None
    True
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.strategies.registry import _StrategyRegistry as StrategyRegistryType  # noqa: F401
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.strategies import ParallelStrategy
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "attached_trainer",
    "current_hook",
    "fit_loop_batches_processed",
    "model_summary_options",
    "model_summary_parts",
    "set_fit_loop_position",
    "default_pg_backend",
    "init_dist_connection",
    "install_subprocess_launcher",
    "set_device_mesh",
    "should_accumulate",
]


# ---------------------------------------------------------------------------------------------- process group
def init_dist_connection(cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta,
                         device: torch.device) -> None:
    """Lightning's private ``lightning.fabric.utilities.distributed._init_dist_connection`` (reuses an
    existing default group)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    _init_dist_connection(cluster_environment, backend, **kwargs)


def default_pg_backend(device: torch.device) -> str:
    """``nccl`` on CUDA, ``gloo`` otherwise (Lightning's private
    ``_get_default_process_group_backend_for_device``)."""
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return _get_default_process_group_backend_for_device(device)


def install_subprocess_launcher(strategy: ParallelStrategy) -> None:
    """Give ``strategy`` Lightning's private ``_SubprocessScriptLauncher`` (re-executes ``sys.argv`` for
    the other local ranks) in its private ``Strategy._launcher`` slot, unless the cluster environment
    creates the processes itself. Called from the strategy's ``_configure_launcher`` hook."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    env = strategy.cluster_environment
    if env is not None and not env.creates_processes_externally:
        strategy._launcher = _SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)


# ---------------------------------------------------------------------------------------------- LightningModule
def set_device_mesh(lightning_module: LightningModule, mesh: DeviceMesh) -> None:
    """Expose ``mesh`` as ``lightning_module.device_mesh`` (a read-only property over the private
    ``LightningModule._device_mesh``, which Lightning's own ``ModelParallelStrategy`` sets the same way)."""
    lightning_module._device_mesh = mesh


def current_hook(module: LightningModule) -> Optional[str]:
    """The name of the Lightning hook running on ``module`` (where ``self.log`` may be called), or ``None`` outside
    any (the private ``LightningModule._current_fx_name``).

    Example:
        >>> import lightning as L
        >>> current_hook(L.LightningModule()) is None
        True
    """
    return getattr(module, "_current_fx_name", None)


def attached_trainer(module: nn.Module) -> Optional[Trainer]:
    """The Trainer ``module`` is attached to, or ``None`` (the private ``LightningModule._trainer``; the
    public ``trainer`` property raises when there is none)."""
    try:
        return module._trainer
    except AttributeError:
        try:
            return module.trainer
        except (AttributeError, RuntimeError):
            return None


# ---------------------------------------------------------------------------------------------- loops
def should_accumulate(trainer: Trainer) -> bool:
    """Whether the current training step is a non-stepping accumulation micro-step (the private
    ``trainer.fit_loop._should_accumulate()``; ``False`` where it is missing)."""
    try:
        return bool(trainer.fit_loop._should_accumulate())
    except AttributeError:
        return False


# ---------------------------------------------------------------------------------------------- checkpoint loop state
# The layout of ``checkpoint["loops"]["fit_loop"]`` is Lightning's (not a public format); pinned by
# tests/unit/test_compat.py against the installed Lightning.
def fit_loop_batches_processed(checkpoint: dict[str, Any]) -> int:
    """Training batches processed before ``checkpoint`` was written (``fit_loop`` batch progress)."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return int(loop.get("epoch_loop.batch_progress", {}).get("total", {}).get("processed", 0))


def _progress(ready: int, started: int, processed: int, completed: int) -> dict[str, int]:
    return {"ready": ready, "started": started, "processed": processed, "completed": completed}


def set_fit_loop_position(checkpoint: dict[str, Any], epoch: int, in_epoch: int, total: int, last_batch: bool) -> None:
    """Rewrite ``checkpoint``'s fit-loop state in place to "saved on train-batch end after batch ``in_epoch``
    (1-based) of epoch ``epoch``, ``total`` batches in all" — the form Lightning restores consistently.

    Also undoes the private ``_batches_that_stepped`` increment Lightning applies on this kind of restart when
    the checkpoint already counts the last batch (saved after it, e.g. ``trainer.save_checkpoint`` after a fit);
    one saved in ``on_train_batch_end`` (``ModelCheckpoint(every_n_train_steps)``, a preemption save: the batch
    is processed, not completed) does not count it yet, and the increment completes it. Resets a half-done
    validation loop.
    """
    fit = checkpoint["loops"]["fit_loop"]
    saved = fit.get("epoch_loop.batch_progress", {}).get("total", {})
    in_batch_end = saved.get("completed") == saved.get("processed", 0) - 1
    fit["epoch_progress"] = {
        "total": _progress(epoch + 1, epoch + 1, epoch, epoch),
        "current": _progress(epoch + 1, epoch + 1, epoch, epoch),
    }
    batch = fit.setdefault("epoch_loop.batch_progress", {})
    batch["total"] = _progress(total, total, total, total - 1)
    batch["current"] = _progress(in_epoch, in_epoch, in_epoch, in_epoch - 1)
    batch["is_last_batch"] = last_batch
    state = fit.setdefault("epoch_loop.state_dict", {})
    if "_batches_that_stepped" in state and not in_batch_end:
        state["_batches_that_stepped"] = max(0, int(state["_batches_that_stepped"]) - 1)
    val = fit.get("epoch_loop.val_loop.batch_progress")
    if isinstance(val, dict):
        val["current"] = {k: 0 for k in val.get("current", {})}
        val["is_last_batch"] = False


# ---------------------------------------------------------------------------------------------- model summary
def model_summary_options(callback: ModelSummary) -> tuple[int, dict[str, Any]]:
    """``(max_depth, summarize_kwargs)`` of Lightning's ``ModelSummary`` callback (private attributes)."""
    return int(callback._max_depth), dict(callback._summarize_kwargs)


def model_summary_parts(callback: ModelSummary, trainer: Trainer,
                        module: LightningModule) -> tuple[list, float, dict, int, int]:
    """What Lightning's ``ModelSummary.on_fit_start`` prints, from its private ``_summary`` and
    ``_get_summary_data``: ``(table rows, model size in MB, training modes, FLOPs, this rank's parameters)``."""
    summary = callback._summary(trainer, module)
    flops = summary.total_flops if hasattr(summary, "total_flops") else 0
    return (summary._get_summary_data(), summary.model_size, summary.total_training_modes, flops,
            summary.total_parameters)
