"""The collectives of context-parallel attention: an all-gather along the sequence whose backward reduce-scatters
the gradients (each rank gets the sum, over all ranks' queries, of its own keys' gradients), and the flat
all-gather / reduce-scatter the K/V all-gather attention (:mod:`.gathered`) calls from its own backward.

Example:
    >>> # not run: needs a process group
    >>> kv = gather_sequence(torch.stack([k, v]), group)  # (cp, 2, B, KV, T/cp, hd)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_flat", "gather_sequence", "reduce_scatter_flat"]

# torch >= 2.10 renamed the tensor collectives (the old names warn); both are public.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's flat ``x`` ``(N,)`` stacked in rank order, ``(cp, N)`` (no autograd).

    Example:
        >>> # not run: needs a process group
        >>> all_gather_flat(torch.ones(3), group).shape  # doctest: +SKIP
        torch.Size([2, 3])
    """
    n = dist.get_world_size(group)
    out = x.new_empty(n * x.numel())  # (cp·N,)
    _all_gather(out, x.contiguous().view(-1), group=group)
    return out.view(n, -1)


def reduce_scatter_flat(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Rank ``r``'s row of ``x`` ``(cp, N)`` summed over all ranks, ``(N,)`` (no autograd).

    Example:
        >>> # not run: needs a process group
        >>> reduce_scatter_flat(torch.ones(2, 3), group).tolist()  # doctest: +SKIP
        [2.0, 2.0, 2.0]
    """
    out = x.new_empty(x[0].numel())
    _reduce_scatter(out, x.contiguous().view(-1), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """Flat buffers: the tensor collectives concatenate along dimension 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # x (...), out (cp, ...)
        ctx.group = group
        return all_gather_flat(x, group).view(-1, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # grad (cp, ...) -> (...)
        return reduce_scatter_flat(grad.reshape(grad.shape[0], -1), ctx.group).view(grad.shape[1:]), None


def gather_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``x`` stacked in rank order ``(cp, *x.shape)``, differentiable: the backward sums the
    gradients of all ranks for each rank's own ``x`` (a reduce-scatter).

    Example:
        >>> # not run: needs a process group
        >>> gather_sequence(torch.ones(2), group).shape  # doctest: +SKIP
        torch.Size([2, 2])
    """
    return _GatherSequence.apply(x, group)
