"""Private Lightning APIs: process-group set-up, the launcher, LightningModule and loop internals.

Example:
    >>> from torch import nn
    >>> attached_trainer(nn.Linear(1, 1)) is None
    True
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch

__all__ = [
    "attached_trainer",
    "default_pg_backend",
    "init_dist_connection",
    "install_subprocess_launcher",
    "set_device_mesh",
    "should_accumulate",
]


# ---------------------------------------------------------------------------------------------- process group
def init_dist_connection(cluster_environment: Any, backend: str, timeout: timedelta, device: torch.device) -> None:
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


def install_subprocess_launcher(strategy: Any) -> None:
    """Give ``strategy`` Lightning's private ``_SubprocessScriptLauncher`` (re-executes ``sys.argv`` for
    the other local ranks) in its private ``Strategy._launcher`` slot, unless the cluster environment
    creates the processes itself. Called from the strategy's ``_configure_launcher`` hook."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    env = strategy.cluster_environment
    if env is not None and not env.creates_processes_externally:
        strategy._launcher = _SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)


# ---------------------------------------------------------------------------------------------- LightningModule
def set_device_mesh(lightning_module: Any, mesh: Any) -> None:
    """Expose ``mesh`` as ``lightning_module.device_mesh`` (a read-only property over the private
    ``LightningModule._device_mesh``, which Lightning's own ``ModelParallelStrategy`` sets the same way)."""
    lightning_module._device_mesh = mesh


def attached_trainer(module: Any) -> Optional[Any]:
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
def should_accumulate(trainer: Any) -> bool:
    """Whether the current training step is a non-stepping accumulation micro-step (the private
    ``trainer.fit_loop._should_accumulate()``; ``False`` where it is missing)."""
    try:
        return bool(trainer.fit_loop._should_accumulate())
    except AttributeError:
        return False
