"""Small collective helpers: sums, module-state broadcast, the global gradient norm.

Example:
    >>> import torch
    >>> all_reduce_sum(torch.ones(1)).item()  # a no-op without a process group
    1.0
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_4d import _compat

__all__ = ["all_reduce_sum", "broadcast_module_state", "global_grad_norm", "to_full"]


def all_reduce_sum(tensor: Tensor, group: Optional[Any] = None) -> Tensor:
    """Sum ``tensor`` in place over ``group`` (identity without a process group).

    Example:
        >>> all_reduce_sum(torch.tensor([2.0]))
        tensor([2.])
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


@torch.no_grad()
def broadcast_module_state(module: nn.Module, src: int = 0) -> None:
    """Broadcast every full (non-DTensor) parameter and buffer from global rank ``src``.

    Called before sharding, so all ranks start from identical weights even if they were
    initialised from different random states.

    Example:
        >>> broadcast_module_state(nn.Linear(2, 2))  # no-op without a process group
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if not t.is_meta]
    # Flatten per dtype so a model costs a handful of broadcasts, not one per tensor.
    by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src)
        offset = 0
        for t in group:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def _local_norm_pow(grads: list[Tensor], norm_type: float) -> Tensor:
    norms = _compat.foreach_norm(grads, norm_type)
    return torch.stack([n.float() for n in norms]).pow(norm_type).sum()


def global_grad_norm(params: Iterable[nn.Parameter], norm_type: float = 2.0, pp_group: Optional[Any] = None) -> Tensor:
    """The norm of all gradients of the model across every shard, equal on every rank.

    DTensor gradients are grouped by (mesh, placements); each group's norm is reduced over its
    own mesh by DTensor (so a ``Replicate`` dimension is counted once and a ``Shard`` dimension
    summed). Pipeline stages hold disjoint parameters, so their ``p``-th powers are summed over
    the ``pp`` group.

    Example:
        >>> lin = nn.Linear(2, 1); lin(torch.ones(1, 2)).sum().backward()
        >>> round(float(global_grad_norm(lin.parameters())), 4)
        1.7321
    """
    if norm_type == float("inf"):
        raise ValueError("norm_type=inf is not supported for global clipping; use 2.0.")
    from torch.distributed.tensor import DTensor

    plain: list[Tensor] = []
    groups: dict[tuple, list[Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            groups[(id(g.device_mesh), tuple(g.placements))].append(g)
        else:
            plain.append(g)
    total = torch.zeros((), dtype=torch.float32)
    if plain:
        total = total + _local_norm_pow(plain, norm_type).cpu()
    for grads in groups.values():
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        for n in norms:
            full = n.full_tensor() if hasattr(n, "full_tensor") else n
            total = total + full.float().cpu().pow(norm_type)
    if pp_group is not None:
        device = next(iter(groups.values()))[0].device if groups else (plain[0].device if plain else "cpu")
        total = total.to(device)
        all_reduce_sum(total, pp_group)
        total = total.cpu()
    return total.pow(1.0 / norm_type)


def to_full(value: Any) -> Any:
    """Replace DTensors (e.g. vocab-sharded logits) by full local tensors, recursively.

    Example:
        >>> to_full({"a": torch.ones(1)})
        {'a': tensor([1.])}
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: to_full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_full(v) for v in value)
    return value
