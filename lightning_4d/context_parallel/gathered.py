"""K/V all-gather attention: every rank's K and V gathered in one collective, attended chunk by chunk.

Each rank packs its K and V ``(…, T/cp, E)`` into one flat buffer and all-gathers it over the cp ranks
(``(cp, ·)``, rank order); its queries (zigzag chunks ``r`` and ``2cp−1−r``) then attend to each rank's chunk pair
in the pieces of :mod:`.blockwise`, merged by log-sum-exp — nothing is reordered or copied into sequence order.
The backward accumulates the gradients of every rank's K/V in one buffer of the gathered layout and
reduce-scatters it (each rank gets its own K/V's gradients summed over all queries). Kept for backward: the
gathered buffer (the whole sequence's K/V, the algorithm's one cost beyond the ``1/cp`` share), q, the output and its
log-sum-exp. Bytes: one all-gather of the stacked K/V per forward and one reduce-scatter of their gradients per
backward (:func:`~.cost.kv_wire_bytes`).

Example:
    >>> # not run: needs a process group
    >>> y = allgather_attention(q, k, v, shard, MaskSpec())  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d.context_parallel.blockwise import PieceRunner, accumulator_dtype, pack, source_runners, start, unpack
from lightning_4d.context_parallel.collectives import all_gather_flat, reduce_scatter_flat
from lightning_4d.context_parallel.masks import MaskSpec

if TYPE_CHECKING:
    from lightning_4d.context_parallel.shard import SequenceShard

__all__ = ["allgather_attention"]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup,
                runners: list[PieceRunner]) -> Tensor:
        gathered = all_gather_flat(pack(k, v), group)  # (cp, numel(k) + numel(v)): every rank's K/V
        out, lse = start(q, v)
        for src, runner in enumerate(runners):
            ks, vs = unpack(gathered[src], (k, v))
            runner.forward(q, ks, vs, out, lse)
        out = out.to(q.dtype)
        ctx.group, ctx.runners = group, runners
        ctx.like = (k.new_empty(k.shape, device="meta"), v.new_empty(v.shape, device="meta"))  # shapes only
        ctx.save_for_backward(q, gathered, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        q, gathered, out, lse = ctx.saved_tensors
        k_like, v_like = ctx.like
        acc = accumulator_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(gathered.shape, dtype=acc, device=q.device)  # (cp, ·): gradients of every rank's K/V
        for src, runner in enumerate(ctx.runners):
            ks, vs = unpack(gathered[src], (k_like, v_like))
            dks, dvs = unpack(dkv[src], (k_like, v_like))
            runner.backward(grad, q, ks, vs, out, lse, dq, dks, dvs)
        own = reduce_scatter_flat(dkv.to(gathered.dtype), ctx.group)  # this rank's K/V, summed over all queries
        dk, dv = unpack(own, (k_like, v_like))
        return dq.to(q.dtype), dk, dv, None, None


def allgather_attention(query: Tensor, key: Tensor, value: Tensor, shard: "SequenceShard", spec: MaskSpec,
                        scale: Optional[float] = None, block: int = 1024) -> Tensor:
    """Attention of this rank's ``query (B, H, T/cp, E)`` over the whole sequence, K/V ``(B, H, T/cp, E|Ev)``
    all-gathered (see the module doc), exact forward and backward; ``spec``: the call's mask (documents from
    ``shard``).

    Example:
        >>> # not run: needs a process group
        >>> allgather_attention(q, k, v, shard, MaskSpec()).shape  # doctest: +SKIP
        torch.Size([2, 4, 8, 8])
    """
    runners = source_runners(shard.ranges(), [shard.ranges(src) for src in range(shard.cp)], spec,
                             shard.documents(spec), scale, shard.positions(spec), block)
    return _AllGatherAttention.apply(query, key, value, shard.group, runners)
