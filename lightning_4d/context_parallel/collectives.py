"""The one collective of context-parallel attention: an all-gather along the sequence whose backward
reduce-scatters the gradients (each rank gets the sum, over all ranks' queries, of its own keys' gradients).

Example:
    >>> # not run: needs a process group
    >>> kv = gather_sequence(torch.stack([k, v]), group)  # (cp, 2, B, KV, T/cp, hd)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["gather_sequence"]

# torch >= 2.10 renamed the tensor collectives (the old names warn); both are public.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """Flat buffers: the tensor collectives concatenate along dimension 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # x (...), out (cp, ...)
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty(n * x.numel())  # (cp·numel,)
        _all_gather(out, x.contiguous().view(-1), group=group)
        return out.view(n, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # grad (cp, ...) -> (...)
        out = grad.new_empty(grad[0].numel())
        _reduce_scatter(out, grad.contiguous().view(-1), group=ctx.group)
        return out.view(grad.shape[1:]), None


def gather_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``x`` stacked in rank order ``(cp, *x.shape)``, differentiable: the backward sums the
    gradients of all ranks for each rank's own ``x`` (a reduce-scatter).

    Example:
        >>> # not run: needs a process group
        >>> gather_sequence(torch.ones(2), group).shape  # doctest: +SKIP
        torch.Size([2, 2])
    """
    return _GatherSequence.apply(x, group)
