"""Ulysses context parallelism (DeepSpeed-Ulysses): attention heads ↔ sequence by all-to-all.

Each rank holds ``T/cp`` tokens (zigzag chunks) of all ``H`` heads. One all-to-all turns q, k and v into ``H/cp``
heads of the whole sequence (put back in global order), attention runs there under the call's mask over the whole
sequence (SDPA's own causal kernel for plain causal attention, else the pieces of :mod:`.blockwise`: no ``(T × T)``
mask), and a second all-to-all returns the output to ``T/cp`` tokens of all heads. The all-to-all with equal splits
is its own transpose, so its backward is the same all-to-all on the gradients: the backward is exact. Usable where
the query and K/V heads of every attention call (per tensor-parallel rank) divide by ``cp``.

Example:
    >>> # not run: needs a process group
    >>> # q, k, v (B, H, T/cp, E) -> y (B, H, T/cp, E); causal over the whole sequence
    >>> y = ulysses_attention(q, k, v, shard, MaskSpec(), "attn")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_4d.context_parallel.blockwise import piecewise_attention
from lightning_4d.context_parallel.masks import MaskSpec, plan_pieces
from lightning_4d.context_parallel.zigzag import gathered_order, restore_order

if TYPE_CHECKING:
    from lightning_4d.context_parallel.shard import SequenceShard

__all__ = ["all_to_all", "heads_to_sequence", "sequence_to_heads", "ulysses_attention"]


class _AllToAll(torch.autograd.Function):
    """``x (cp, ...)``: slice ``j`` goes to rank ``j``; the result's slice ``j`` came from rank ``j``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # (cp, ...) -> (cp, ...)
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # the transpose: the same exchange
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Differentiable all-to-all with equal splits along dimension 0 (``cp`` slices); its backward is itself.

    Example:
        >>> # not run: needs a process group
        >>> all_to_all(torch.arange(2.0)[:, None], group).shape  # doctest: +SKIP
        torch.Size([2, 1])
    """
    return _AllToAll.apply(x, group)


def sequence_to_heads(x: Tensor, cp: int, seq_len: int, group: dist.ProcessGroup) -> Tensor:
    """``(…, H, T/cp, E)`` this rank's tokens of all heads -> ``(…, H/cp, T, E)`` its heads of the whole sequence,
    in global order (rank ``r`` gets heads ``r·H/cp .. (r+1)·H/cp − 1``).

    Example:
        >>> # not run: needs a process group
        >>> sequence_to_heads(torch.zeros(1, 4, 8, 2), 2, 16, group).shape  # doctest: +SKIP
        torch.Size([1, 2, 16, 2])
    """
    heads = x.shape[-3]
    parts = x.unflatten(-3, (cp, heads // cp)).movedim(-4, 0)  # (cp, …, H/cp, T/cp, E)
    got = all_to_all(parts, group)  # (cp, …, H/cp, T/cp, E): slice j = rank j's tokens
    whole = got.movedim(0, -3).flatten(-3, -2)  # (…, H/cp, T, E) in gathered (rank) order
    return whole.index_select(-2, restore_order(seq_len, cp, device=x.device))  # (…, H/cp, T, E) global order


def heads_to_sequence(y: Tensor, cp: int, seq_len: int, group: dist.ProcessGroup) -> Tensor:
    """The inverse of :func:`sequence_to_heads`: ``(…, H/cp, T, E)`` -> ``(…, H, T/cp, E)``.

    Example:
        >>> # not run: needs a process group
        >>> heads_to_sequence(torch.zeros(1, 2, 16, 2), 2, 16, group).shape  # doctest: +SKIP
        torch.Size([1, 4, 8, 2])
    """
    ranked = y.index_select(-2, gathered_order(seq_len, cp, device=y.device))  # (…, H/cp, T, E) rank order
    parts = ranked.unflatten(-2, (cp, seq_len // cp)).movedim(-3, 0)  # (cp, …, H/cp, T/cp, E): slice j to rank j
    got = all_to_all(parts, group)  # (cp, …, H/cp, T/cp, E): slice j = head group j
    return got.movedim(0, -4).flatten(-4, -3)  # (…, H, T/cp, E)


def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, shard: "SequenceShard", spec: MaskSpec, where: str,
                      dropout_p: float = 0.0, scale: Optional[float] = None, block: int = 1024) -> Tensor:
    """``F.scaled_dot_product_attention`` over the whole sequence for this rank's chunk ``(…, H, T/cp, E)`` under
    ``spec`` (documents from ``shard``): heads ↔ sequence all-to-all, attention on ``H/cp`` heads of ``T`` tokens,
    all-to-all back. q, k and v travel in one all-to-all when their shapes agree. ``dropout_p > 0``: one SDPA call
    with the whole ``(T × T)`` mask (dropout cannot be replayed piece by piece).

    Raises:
        ValueError: head counts not divisible by ``cp`` (naming ``where``).

    Example:
        >>> # not run: needs a process group
        >>> ulysses_attention(q, k, v, shard, MaskSpec(), "attn").shape  # doctest: +SKIP
        torch.Size([2, 4, 8, 8])
    """
    cp, seq_len, group = shard.cp, shard.seq_len, shard.group
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if heads % cp or kv_heads % cp or value.shape[-3] % cp:
        raise ValueError(
            f"{where}: Ulysses context parallelism splits the attention heads over cp={cp} ranks, but this call has "
            f"{heads} query and {kv_heads} K/V heads per rank. Use cp_algorithm='allgather' or 'ring' (or 'auto').")
    if query.shape == key.shape == value.shape and query.dtype == key.dtype == value.dtype:
        q, k, v = sequence_to_heads(torch.stack([query, key, value]), cp, seq_len, group).unbind(0)  # (…, H/cp, T, E)
    else:
        q, k, v = (sequence_to_heads(t, cp, seq_len, group) for t in (query, key, value))
    docs, positions = shard.documents(spec), shard.positions(spec)
    if dropout_p > 0.0:
        idx = torch.arange(seq_len, device=q.device)
        docs_, pos_ = (None if t is None else t.to(q.device) for t in (docs, positions))
        mask = spec.allowed(idx, idx, docs_, docs_, pos_, pos_)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    elif docs is None and spec.kind in ("causal", "full"):  # SDPA's own kernels, no mask
        y = F.scaled_dot_product_attention(q, k, v, is_causal=spec.kind == "causal", scale=scale)  # (…, H/cp, T, Ev)
    else:
        pieces = plan_pieces([(0, seq_len)], [(0, seq_len)], spec, docs is not None, block)
        y = piecewise_attention(q, k, v, pieces, spec, docs, scale, positions)  # (…, H/cp, T, Ev)
    return heads_to_sequence(y, cp, seq_len, group)  # (…, H, T/cp, Ev)
