"""Data parallelism over the ``dp`` axis (and ``edp`` for experts) with FSDP2 or replicate.

``fully_shard`` (FSDP2, default) shards every parameter over the data-parallel ranks and
reduce-scatters gradients; ``replicate`` keeps full copies and all-reduces gradients. Both are
applied per repeated block and then to the root, like TorchTitan, and both average gradients over
their mesh. Gradient sync can be switched off for the non-stepping micro-steps of gradient
accumulation.

Example:
    >>> # not run: needs a process group
    >>> apply_data_parallel(model, mesh["dp"], blocks=list(model.layers), mode="fsdp")  # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Iterable, Literal, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_4d import _compat
from lightning_4d.core.precision import precision_info

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["DataParallelMode", "apply_data_parallel", "mixed_precision_policy", "reshards_after_forward",
           "set_gradient_sync", "wrap_mode"]

DataParallelMode = Literal["fsdp", "replicate"]  # how one mesh wraps; HSDP is "fsdp" over a 2-D mesh


def wrap_mode(data_parallel: str, experts: bool = False) -> DataParallelMode:
    """How a unit is wrapped for a ``data_parallel`` option: HSDP is FSDP2 on the 2-D dense mesh, and expert
    units (over ``edp``) stay plain FSDP2 under it. The planner models the same rule.

    Example:
        >>> wrap_mode("hsdp"), wrap_mode("hsdp", experts=True), wrap_mode("replicate")
        ('fsdp', 'fsdp', 'replicate')
    """
    return "fsdp" if data_parallel == "hsdp" else data_parallel  # type: ignore[return-value]


def reshards_after_forward(pp: int) -> bool:
    """Whether the package's FSDP2 blocks and expert units free their gathered parameters after forward: only
    without pipelining (under it a stage keeps them gathered from its first forward to its last backward, one
    all-gather per step instead of one per micro-batch; TorchTitan's choice). The planner models the same rule.

    Example:
        >>> reshards_after_forward(1), reshards_after_forward(4)
        (True, False)
    """
    return pp == 1


def mixed_precision_policy(precision: str) -> Optional[MixedPrecisionPolicy]:
    """FSDP2 mixed-precision policy for a Lightning precision string (``None``: none; the table's
    ``fsdp_param_dtype``, :data:`lightning_4d.core.precision.PRECISIONS`).

    Example:
        >>> mixed_precision_policy("32-true") is None
        True
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = precision_info(precision).fsdp_param_dtype
    if param_dtype is not None:
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return None


def _wrap(module: nn.Module, mesh: DeviceMesh, mode: str, mp_policy: Optional[MixedPrecisionPolicy], reshard: bool,
          ignored: Optional[set[nn.Parameter]] = None) -> None:
    ignored = {p for p in (ignored or set()) if any(p is q for q in module.parameters())} or None
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard, "ignored_params": ignored}
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        fully_shard(module, **kwargs)
    else:
        _compat.replicate(module, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored)


def apply_data_parallel(
    root: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Iterable[nn.Module] = (),
    mode: str = "fsdp",
    precision: str = "32-true",
    expert_modules: Iterable[nn.Module] = (),
    expert_mesh: Optional[DeviceMesh] = None,
    ignored_params: Optional[set[nn.Parameter]] = None,
    reshard_after_forward: bool = True,
    reshard_root: bool = False,
) -> nn.Module:
    """Wrap each block, then the root, for data parallelism over ``mesh`` (the dp axis; a 2-D
    ``(dp_replicate, dp_shard)`` mesh with ``mode="fsdp"`` is HSDP).

    Expert modules (whose parameters are sharded over ``ep``) are wrapped first over
    ``expert_mesh`` (the ``edp`` axis), so their gradients are averaged only over the ranks
    that hold the same experts. ``ignored_params`` are left alone (e.g. experts when ``edp == 1``).
    ``reshard_after_forward=False`` keeps gathered parameters between forward and backward (used under
    pipeline parallelism, where every micro-batch would otherwise gather them again); ``reshard_root``
    frees the root's gathered parameters after forward too (used for expert modules, whose forward is
    not followed at once by their backward).

    Example:
        >>> # not run: needs a process group
        >>> apply_data_parallel(model, mesh["dp"], blocks=model.layers, mode="replicate")  # doctest: +SKIP
    """
    if mode not in ("fsdp", "replicate"):
        raise ValueError(f"apply_data_parallel: mode={mode!r}; use 'fsdp' (a 2-D mesh gives HSDP) or 'replicate'.")
    mp_policy = mixed_precision_policy(precision)
    for module in expert_modules:
        _wrap(module, expert_mesh, mode, mp_policy, reshard=True)
    block_list = list(blocks)
    for i, block in enumerate(block_list):
        # The last block's parameters are needed again right away in backward.
        reshard = reshard_after_forward and i < len(block_list) - 1
        _wrap(block, mesh, mode, mp_policy, reshard=reshard, ignored=ignored_params)
    _wrap(root, mesh, mode, mp_policy, reshard=reshard_root, ignored=ignored_params)
    return root


def data_parallel_roots(module: nn.Module) -> list[nn.Module]:
    """Every FSDP2 / replicate-wrapped module inside ``module`` (root included).

    Example:
        >>> data_parallel_roots(nn.Linear(2, 2))
        []
    """
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule) or hasattr(m, "set_requires_gradient_sync")]


_ROOTS: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Switch gradient reduction on/off (off on the non-stepping micro-steps of accumulation). Called every step: the
    wrapped modules are found once per ``module`` (set-up has wrapped them all by the first step), not by a walk
    over every module each time.

    Example:
        >>> set_gradient_sync(nn.Linear(2, 2), False)  # no-op without data parallelism
    """
    roots = _ROOTS.get(module)
    if roots is None:
        roots = _ROOTS[module] = data_parallel_roots(module)
    for wrapped in roots:
        wrapped.set_requires_gradient_sync(enabled, recurse=False)
