"""Exact attention over a sequence in pieces, merged by log-sum-exp: no ``(queries × keys)`` mask, ever.

The queries (a rank's zigzag chunks, or Ulysses' whole sequence) attend to keys (the gathered sequence, or one ring
step's chunks) in the pieces :func:`~.masks.plan_pieces` cuts: keys wholly before a query chunk need no mask, the
diagonal piece is causal, pieces a window, chunk or document boundary excludes are skipped, and only a window's or
document's edge gets a mask of the piece's size (built on the device from global indices and document ids, used and
dropped, rebuilt in backward). Each piece runs a fused kernel that also returns its log-sum-exp
(:func:`~lightning_4d._compat.attention_with_lse`); pieces merge exactly:
``lse = logaddexp(lse₁, lse₂)``, ``out = out₁·e^(lse₁−lse) + out₂·e^(lse₂−lse)``. The backward runs each piece's
kernel backward with the merged output and log-sum-exp (the flash-attention backward), whose gradients sum to the
whole attention's. Saved for backward: q, k, v, the output and its log-sum-exp — what SDPA's flash kernel keeps.

Example:
    >>> from lightning_4d.context_parallel.masks import MaskSpec
    >>> q = torch.randn(1, 2, 8, 4)
    >>> pieces = plan_pieces([(0, 8)], [(0, 8)], MaskSpec("window", 3), block=2)
    >>> y = piecewise_attention(q, q, q, pieces, MaskSpec("window", 3))
    >>> mask = MaskSpec("window", 3).allowed(torch.arange(8), torch.arange(8))
    >>> bool(torch.allclose(y, F.scaled_dot_product_attention(q, q, q, attn_mask=mask), atol=1e-6))
    True
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_4d import _compat
from lightning_4d.context_parallel.masks import MaskSpec, Piece, plan_pieces

__all__ = ["PieceRunner", "merge_into", "pack", "piecewise_attention", "plan_pieces", "source_runners", "unpack"]


def merge_into(out: Tensor, lse: Tensor, piece_out: Tensor, piece_lse: Tensor) -> None:
    """Merge one piece's ``(piece_out (…, n, Ev), piece_lse (…, n))`` into the running ``out`` (fp32) and ``lse``
    (fp32, ``-inf`` before the first piece), in place. Rows a piece leaves without keys (``lse`` at ``-inf`` or
    the dtype's minimum) add nothing.

    Example:
        >>> out, lse = torch.zeros(1, 1, 2), torch.full((1, 1), float("-inf"))
        >>> merge_into(out, lse, torch.ones(1, 1, 2), torch.zeros(1, 1))
        >>> merge_into(out, lse, 3 * torch.ones(1, 1, 2), torch.zeros(1, 1))
        >>> out.tolist(), round(float(lse), 4)
        ([[[2.0, 2.0]]], 0.6931)
    """
    new = torch.logaddexp(lse, piece_lse)  # (…, n)
    old_w = torch.exp(lse - new).nan_to_num(0.0)[..., None]  # -inf - -inf: nan -> 0
    new_w = torch.exp(piece_lse - new).nan_to_num(0.0)[..., None]
    out.mul_(old_w).add_(torch.where(new_w > 0, piece_out.to(out.dtype) * new_w, 0.0))
    lse.copy_(new)


class PieceRunner:
    """The kernel calls of one attention: ``pieces`` (:class:`~.masks.Piece`) under ``spec``, with document ids
    ``docs`` and their ``positions`` (``position_ids``) ``(B, T)`` over global indices when the spec keeps documents
    apart, ``scale`` (``None``: ``E^-½``).

    :meth:`forward` accumulates into an output / log-sum-exp pair; :meth:`backward` into gradient buffers, from the
    merged output and log-sum-exp (so a ring can call both once per step)."""

    def __init__(self, pieces: Sequence[Piece], spec: MaskSpec, docs: Optional[Tensor], scale: Optional[float],
                 positions: Optional[Tensor] = None) -> None:
        self.pieces, self.spec, self.scale = list(pieces), spec, scale
        self.docs = docs if spec.documents else None
        self.positions = positions if spec.documents else None

    def mask(self, p: Piece, dtype: torch.dtype, device: torch.device) -> Optional[Tensor]:
        """The additive mask ``(1 or B, 1, nq, nk)`` of a ``"masked"`` piece, else ``None``."""
        if p.kind != "masked":
            return None
        q = torch.arange(p.q0, p.q0 + p.qe - p.qs, device=device)
        k = torch.arange(p.k0, p.k0 + p.ke - p.ks, device=device)
        docs = self.docs.to(device) if self.docs is not None else None
        pos = self.positions.to(device) if self.positions is not None else None
        allowed = self.spec.allowed(q, k, None if docs is None else docs[:, q], None if docs is None else docs[:, k],
                                    None if pos is None else pos[:, q], None if pos is None else pos[:, k])
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> None:
        """Attention of ``q (B, H, Nq, E)`` to ``k``/``v (B, H, Nk, E)``, merged into ``out (B, H, Nq, Ev)`` and
        ``lse (B, H, Nq)`` (fp32)."""
        for p in self.pieces:
            o, l = _compat.attention_with_lse(q[..., p.qs:p.qe, :], k[..., p.ks:p.ke, :], v[..., p.ks:p.ke, :],
                                              p.kind == "causal", self.mask(p, q.dtype, q.device), self.scale)
            merge_into(out[..., p.qs:p.qe, :], lse[..., p.qs:p.qe], o, l)

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dq: Tensor,
                 dk: Tensor, dv: Tensor) -> None:
        """Each piece's gradients for ``grad`` on the merged ``out`` / ``lse``, added to ``dq``, ``dk``, ``dv``
        (fp32)."""
        for p in self.pieces:
            gq, gk, gv = _compat.attention_with_lse_backward(
                grad[..., p.qs:p.qe, :], q[..., p.qs:p.qe, :], k[..., p.ks:p.ke, :], v[..., p.ks:p.ke, :],
                out[..., p.qs:p.qe, :], lse[..., p.qs:p.qe].contiguous(), p.kind == "causal",
                self.mask(p, q.dtype, q.device), self.scale)
            dq[..., p.qs:p.qe, :] += gq
            dk[..., p.ks:p.ke, :] += gk
            dv[..., p.ks:p.ke, :] += gv


def source_runners(queries: Sequence[tuple[int, int]], sources: Sequence[Sequence[tuple[int, int]]], spec: MaskSpec,
                   docs: Optional[Tensor], scale: Optional[float], positions: Optional[Tensor],
                   block: int) -> list[PieceRunner]:
    """One :class:`PieceRunner` per source rank: queries at the sequence ranges ``queries`` against the keys each
    rank holds (``sources[r]``: its ranges, laid out one after the other), what the K/V all-gather and the ring run
    per rank's chunk pair."""
    return [PieceRunner(plan_pieces(queries, ranges, spec, docs is not None, block), spec, docs, scale, positions)
            for ranges in sources]


def pack(*tensors: Tensor) -> Tensor:
    """One flat buffer of ``tensors`` (one message / collective for all of them).

    Example:
        >>> a, b = unpack(pack(torch.ones(2), torch.zeros(1, 3)), (torch.ones(2), torch.zeros(1, 3)))
        >>> a.tolist(), b.shape
        ([1.0, 1.0], torch.Size([1, 3]))
    """
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like ``like`` (the inverse of :func:`pack`)."""
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def accumulator_dtype(q: Tensor) -> torch.dtype:
    """The dtype pieces merge in: fp32 (fp64 for fp64 queries)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def start(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """An empty output ``(B, H, Nq, Ev)`` and log-sum-exp ``(B, H, Nq)`` (``-inf``) to merge pieces into
    (:func:`accumulator_dtype`)."""
    acc = accumulator_dtype(q)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
    return out, torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)


def finish(ctx: Any, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> Tensor:
    """The merged output in the queries' dtype, saved for backward with q, k, v and the log-sum-exp."""
    out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse)
    return out


class _Piecewise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, runner: PieceRunner) -> Tensor:
        out, lse = start(q, v)
        runner.forward(q, k, v, out, lse)
        ctx.runner = runner
        return finish(ctx, q, k, v, out, lse)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = (torch.zeros(t.shape, dtype=accumulator_dtype(q), device=t.device) for t in (q, k, v))
        ctx.runner.backward(grad, q, k, v, out, lse, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def piecewise_attention(q: Tensor, k: Tensor, v: Tensor, pieces: Sequence[Piece], spec: MaskSpec,
                        docs: Optional[Tensor] = None, scale: Optional[float] = None,
                        positions: Optional[Tensor] = None) -> Tensor:
    """Differentiable attention of ``q (B, H, Nq, E)`` to ``k``/``v (B, H, Nk, E|Ev)`` in ``pieces`` (from
    :func:`~.masks.plan_pieces` over the sequence ranges the rows of ``q`` and ``k`` hold), exact in forward and
    backward (see the module doc). ``docs`` / ``positions`` ``(B, T)``: document ids and position ids over global
    indices, for ``spec.documents``.

    Example:
        >>> q = torch.randn(1, 1, 4, 2)
        >>> y = piecewise_attention(q, q, q, plan_pieces([(0, 4)], [(0, 4)], MaskSpec()), MaskSpec())
        >>> bool(torch.allclose(y, F.scaled_dot_product_attention(q, q, q, is_causal=True), atol=1e-6))
        True
    """
    return _Piecewise.apply(q, k, v, PieceRunner(pieces, spec, docs, scale, positions))
