"""The one place that touches private torch / Lightning APIs, version-gated where it matters.

Everything here is an implementation detail. Each helper names the private symbol it uses so
an upgrade of torch or Lightning only needs changes in this file.

Example:
    >>> from lightning_4d import _compat
    >>> callable(_compat.replicate)
    True
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "mesh_backend_override",
    "replicate",
    "init_dist_connection",
    "default_pg_backend",
    "subprocess_launcher",
    "materialize_meta_module",
    "TORCH_VERSION",
    "should_accumulate",
]

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def mesh_backend_override(backend: str, timeout: Optional[timedelta], ndim: int) -> Optional[tuple]:
    """Per-dimension ``(backend, options)`` for ``DeviceMesh`` so sub-groups inherit our timeout.

    ``DeviceMesh`` sub-groups otherwise get torch's 30-minute default instead of the world's
    timeout, and a failing rank would leave the others hanging. Uses the private
    ``ProcessGroupGloo._Options`` / ``ProcessGroupNCCL.Options`` ``_timeout`` field.
    """
    if timeout is None:
        return None
    try:
        if backend == "gloo":
            opts: Any = dist.ProcessGroupGloo._Options()
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
        else:
            return None
        opts._timeout = timeout
    except (AttributeError, RuntimeError):
        return None
    return tuple((backend, opts) for _ in range(ndim))


def replicate(module: nn.Module, mesh: Any, mp_policy: Any = None, ignored_params: Any = None) -> nn.Module:
    """Data-parallel replication built on FSDP2 machinery (``torch.distributed._composable``).

    It keeps full parameters on every rank and all-reduces gradients, and composes with
    DTensor tensor-parallel parameters like ``fully_shard`` does.
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate as _replicate

    kwargs: dict[str, Any] = {"mesh": mesh, "ignored_params": ignored_params}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    return _replicate(module, **kwargs)


def init_dist_connection(cluster_environment: Any, backend: str, timeout: timedelta, device: torch.device) -> None:
    """Lightning's private process-group initialiser (reuses an existing default group)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    _init_dist_connection(cluster_environment, backend, **kwargs)


def default_pg_backend(device: torch.device) -> str:
    """``nccl`` on CUDA, ``gloo`` otherwise (Lightning's private helper)."""
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return _get_default_process_group_backend_for_device(device)


def subprocess_launcher(cluster_environment: Any, num_processes: int, num_nodes: int) -> Any:
    """Lightning's private subprocess launcher (re-executes ``sys.argv`` for the other local ranks)."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    return _SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)


def materialize_meta_module(module: nn.Module, device: torch.device) -> None:
    """Allocate meta parameters on ``device`` and re-run every module's ``reset_parameters``.

    Runs on full (unsharded) tensors, in module order, so a seeded single process and every
    rank draw identical initial weights. Modules may provide ``reset_parameters()``; the root
    may provide ``init_weights()`` which then runs last (e.g. to re-tie embeddings).
    """
    if not any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        return
    module.to_empty(device=device)
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    for sub in module.modules():
        init = getattr(sub, "init_weights", None)
        if callable(init):
            init()


def should_accumulate(trainer: Any) -> bool:
    """Whether the current training step is a non-stepping accumulation micro-step (private loop API)."""
    try:
        return bool(trainer.fit_loop._should_accumulate())
    except AttributeError:
        return False
