"""Ring attention: K/V passed around the ``cp`` ranks one chunk at a time, the next chunk's send / receive
overlapping the current chunk's attention.

Rank ``r`` keeps its queries (zigzag chunks ``r`` and ``2cp−1−r``) and, at step ``s = 0 .. cp−1``, holds the K/V of
rank ``(r − s) mod cp``: it attends to them in the pieces of :mod:`.blockwise` (chunks wholly before a query chunk
unmasked, the diagonal causal, excluded ones skipped; windows, chunks and documents as everywhere) and merges the
result by log-sum-exp, while the K/V of step ``s + 1`` travel from rank ``r − 1`` (async point-to-point). Only one
remote chunk pair is held at a time: nothing of the whole sequence is kept for backward.

The backward runs the ring again: at each step the gradients of the K/V chunk held are accumulated into a buffer
that travels with the chunk (received from ``r − 1`` while the step computes, sent on to ``r + 1`` after it), and a
last hop returns every chunk's summed gradients to its owner. Bytes one rank sends per layer and micro-batch, with
``L`` its own K/V (:func:`~.cost.ring_wire_bytes`): ``(cp − 1)·L`` in forward (again when activation checkpointing
recomputes it), ``(cp − 1)·L`` (K/V) plus ``cp·L`` (their gradients) in backward.

Example:
    >>> # not run: needs a process group
    >>> y = ring_attention(q, k, v, shard, MaskSpec())  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d.context_parallel.blockwise import accumulator_dtype, finish, pack, source_runners, start, unpack
from lightning_4d.context_parallel.masks import MaskSpec

if TYPE_CHECKING:
    from lightning_4d.context_parallel.shard import SequenceShard

__all__ = ["ring_attention"]


class _Ring:
    """The ring of one attention call: peers, this rank's pieces against each rank's chunks."""

    def __init__(self, shard: "SequenceShard", spec: MaskSpec, scale: Optional[float], block: int) -> None:
        group = shard.group
        self.group, self.cp, self.rank = group, shard.cp, shard.rank
        self.next = dist.get_global_rank(group, (shard.rank + 1) % shard.cp)
        self.prev = dist.get_global_rank(group, (shard.rank - 1) % shard.cp)
        self.runners = source_runners(shard.ranges(), [shard.ranges(src) for src in range(shard.cp)], spec,
                                      shard.documents(spec), scale, shard.positions(spec), block)

    def source(self, step: int) -> int:
        """The rank whose K/V this rank holds at ``step``."""
        return (self.rank - step) % self.cp

    def exchange(self, sends: list[Optional[Tensor]], recvs: list[Optional[Tensor]]) -> list[Any]:
        """Start sending ``sends`` to the next rank and receiving ``recvs`` from the previous one (async). Every
        rank posts the same messages in the same order, so sends and receives pair up in order (NCCL ignores
        tags)."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sends if t is not None]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recvs if t is not None]
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: _Ring) -> Tensor:
        out, lse = start(q, v)
        held = pack(k, v)  # this rank's K/V, then each previous rank's in turn
        for step in range(ring.cp):
            incoming = torch.empty_like(held) if step < ring.cp - 1 else None
            works = ring.exchange([held if incoming is not None else None], [incoming])  # during this step
            kh, vh = unpack(held, (k, v))
            ring.runners[ring.source(step)].forward(q, kh, vh, out, lse)
            _wait(works)
            held = incoming if incoming is not None else held
        ctx.ring = ring
        return finish(ctx, q, k, v, out, lse)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        acc = accumulator_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        held = pack(k, v)
        done: Optional[Tensor] = None  # the previous step's chunk gradients, to pass on
        for step in range(ring.cp):
            incoming = torch.empty_like(held) if step < ring.cp - 1 else None
            arriving = torch.empty_like(held) if step > 0 else None  # the held chunk's gradients so far
            works = ring.exchange([held if incoming is not None else None, done], [incoming, arriving])
            kh, vh = unpack(held, (k, v))
            dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
            ring.runners[ring.source(step)].backward(grad, q, kh, vh, out, lse, dq, dk, dv)
            _wait(works)
            done = pack(dk.to(k.dtype), dv.to(v.dtype))
            if arriving is not None:
                done = done + arriving
            held = incoming if incoming is not None else held
        own = torch.empty_like(held)
        _wait(ring.exchange([done], [own]))  # the last hop: every chunk's summed gradients back to its owner
        dk, dv = unpack(own, (k, v))
        return dq.to(q.dtype), dk, dv, None


def ring_attention(query: Tensor, key: Tensor, value: Tensor, shard: "SequenceShard", spec: MaskSpec,
                   scale: Optional[float] = None, block: int = 1024) -> Tensor:
    """Attention of this rank's ``query (B, H, T/cp, E)`` over the whole sequence, K/V ``(B, H, T/cp, E|Ev)``
    passed around the ring (see the module doc), exact forward and backward; ``spec``: the call's mask (documents
    from ``shard``).

    Example:
        >>> # not run: needs a process group
        >>> ring_attention(q, k, v, shard, MaskSpec()).shape  # doctest: +SKIP
        torch.Size([2, 4, 8, 8])
    """
    return _RingAttention.apply(query, key.contiguous(), value.contiguous(), _Ring(shard, spec, scale, block))
