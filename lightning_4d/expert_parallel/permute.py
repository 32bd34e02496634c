"""Token permutation for mixture-of-experts layers. Pure tensor index math, no process group.

A router assigns each of ``N`` tokens to ``k`` experts, giving ``N·k`` *assignments* (slots). To run
the experts as one grouped matmul, the assignments are sorted by expert; to run them on ``ep`` ranks,
the sorted rows are cut into ``ep`` contiguous pieces (experts ``[r·E/ep, (r+1)·E/ep)`` live on rank
``r``); after the experts the rows are scattered back to their tokens, weighted by the router.

Example:
    >>> idx = torch.tensor([[1, 0], [1, 2]])           # (N=2, k=2) expert of every slot
    >>> plan = make_permutation(idx, num_experts=3)
    >>> plan.token_index.tolist(), plan.tokens_per_expert.tolist()
    ([0, 0, 1, 1], [1, 2, 1])
    >>> split_sizes(plan.tokens_per_expert, ep=3).tolist()
    [1, 2, 1]
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch

__all__ = [
    "FIXED_ROUTING",
    "expert_counts",
    "FixedRouting",
    "PermutePlan",
    "compute_capacity",
    "make_permutation",
    "permute",
    "unpermute",
    "split_sizes",
    "regroup_by_expert",
    "inverse_permutation",
]


@dataclass(frozen=True)
class PermutePlan:
    """Where every kept assignment goes and comes back from.

    Attributes:
        token_index: ``(M,)`` source token row of each permuted row (sorted by expert, then token).
        slot_index: ``(M,)`` flat assignment index ``token·k + j`` of each permuted row.
        tokens_per_expert: ``(E,)`` kept assignments per expert (int64); sums to ``M``.
        routed_per_expert: ``(E,)`` assignments per expert before capacity dropping.
        num_dropped: ``()`` int64 tensor, assignments dropped by the capacity limit.
        num_tokens: ``N``.
        capacity: per-expert capacity, or ``None`` (dropless).
    """

    token_index: torch.Tensor
    slot_index: torch.Tensor
    tokens_per_expert: torch.Tensor
    routed_per_expert: torch.Tensor
    num_dropped: torch.Tensor
    num_tokens: int
    capacity: Optional[int]


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert ``(E,)`` int64 of expert ids ``indices`` (any shape, values in ``[0, E)``): a
    ``scatter_add`` into ``E`` bins, so the output's size is known without reading the ids on the host (``bincount``
    reads their maximum: a host sync on a GPU). An id outside ``[0, E)`` is an index error.

    Example:
        >>> expert_counts(torch.tensor([[1, 0], [1, 2]]), 4).tolist()
        [1, 2, 1, 0]
    """
    flat = indices.reshape(-1).long()  # (N·k,)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,)


def compute_capacity(num_assignments: int, num_experts: int, capacity_factor: float) -> int:
    """Per-expert capacity ``ceil(capacity_factor · N·k / E)`` (GShard / Switch), at least 1.

    Example:
        >>> compute_capacity(num_assignments=10, num_experts=4, capacity_factor=1.0)
        3
    """
    if capacity_factor <= 0:
        raise ValueError(
            f"capacity_factor={capacity_factor} must be > 0 (it scales the per-expert slots N·k/E). "
            f"Use e.g. 1.25, or capacity_factor=None for dropless routing."
        )
    return max(1, math.ceil(capacity_factor * num_assignments / num_experts))


def make_permutation(
    indices: torch.Tensor,
    num_experts: int,
    scores: Optional[torch.Tensor] = None,
    capacity: Optional[int] = None,
) -> PermutePlan:
    """Sort the ``N·k`` assignments by expert, optionally dropping overflow beyond ``capacity``.

    Args:
        indices: ``(N, k)`` expert id of every assignment.
        num_experts: ``E``.
        scores: ``(N, k)`` routing scores; with a capacity, each expert keeps its ``capacity``
            highest-scoring assignments (ties: lower token index wins). Deterministic.
        capacity: per-expert limit, or ``None`` for dropless routing.

    Returns:
        A :class:`PermutePlan`; within an expert, kept rows stay in token order.

    Example:
        >>> idx = torch.tensor([[0], [0], [0], [1]])
        >>> sc = torch.tensor([[0.2], [0.9], [0.5], [1.0]])
        >>> plan = make_permutation(idx, 2, scores=sc, capacity=2)
        >>> plan.token_index.tolist(), int(plan.num_dropped)
        ([1, 2, 3], 1)
    """
    if indices.dim() != 2:
        raise ValueError(f"indices must be (N, k), got shape {tuple(indices.shape)}")
    n, k = indices.shape
    flat = indices.reshape(-1).long()  # (N·k,)
    routed = expert_counts(flat, num_experts)  # (E,)
    if capacity is None:
        order = torch.sort(flat, stable=True).indices  # (M,) slots sorted by expert, then token
        kept_per_expert = routed
        dropped = torch.zeros((), dtype=torch.long, device=flat.device)
    else:
        if scores is None:
            raise ValueError("capacity dropping needs the routing scores (N, k) to decide which tokens to keep")
        if capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0")
        by_score = torch.sort(-scores.reshape(-1).float(), stable=True).indices  # (N·k,) best first, ties by slot
        by_expert = by_score[torch.sort(flat[by_score], stable=True).indices]  # (N·k,) expert-major, best first
        starts = torch.cumsum(routed, 0) - routed  # (E,)
        rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[by_expert]]
        kept = by_expert[rank_in_expert < capacity]  # (M,) surviving slots
        order = kept[torch.sort(flat[kept] * (n * k) + kept).indices]  # (M,) expert-major, token order
        kept_per_expert = routed.clamp(max=capacity)
        dropped = (routed - kept_per_expert).sum()
    return PermutePlan(
        token_index=torch.div(order, k, rounding_mode="floor"),
        slot_index=order,
        tokens_per_expert=kept_per_expert,
        routed_per_expert=routed,
        num_dropped=dropped,
        num_tokens=n,
        capacity=capacity,
    )


@dataclass(frozen=True)
class FixedRouting:
    """Routing decided outside the router and alike on every rank, for the package's MoE layers while it is
    set in :data:`FIXED_ROUTING` (the planner's dry run routes uniformly on fake tensors this way).

    Attributes:
        assign: ``(N·k, E) -> (N·k,)`` expert of every assignment, replacing the router's choice.
        host: context for the host-side index math (expert ids, counts, split sizes), e.g. real tensors
            inside a fake-tensor mode.

    Example:
        >>> fixed = FixedRouting(lambda m, e: torch.arange(m) % e)
        >>> fixed.permutation(torch.zeros(3, 2, dtype=torch.long), 4, capacity=None).tokens_per_expert.tolist()
        [2, 2, 1, 1]
    """

    assign: Callable[[int, int], torch.Tensor]
    host: Callable[[], ContextManager[object]] = contextlib.nullcontext

    def permutation(self, indices: torch.Tensor, num_experts: int, capacity: Optional[int]) -> PermutePlan:
        """:func:`make_permutation` of the fixed assignments for the router's ``indices (N, k)`` (in ``host``)."""
        n, k = indices.shape
        with self.host():
            idx = self.assign(n * k, num_experts).view(n, k).to(indices.device)  # (N, k)
            scores = torch.ones(n, k, device=indices.device) if capacity is not None else None  # (N, k)
            return make_permutation(idx, num_experts, scores=scores, capacity=capacity)


#: The :class:`FixedRouting` in effect (``None``: routers decide); set and reset it around a forward.
FIXED_ROUTING: ContextVar[Optional[FixedRouting]] = ContextVar("lightning_4d_fixed_routing", default=None)


def permute(x: torch.Tensor, plan: PermutePlan) -> torch.Tensor:
    """Gather token rows into expert order: ``(N, H) -> (M, H)``. Differentiable.

    Example:
        >>> plan = make_permutation(torch.tensor([[1], [0]]), 2)
        >>> permute(torch.tensor([[10.0], [20.0]]), plan).flatten().tolist()
        [20.0, 10.0]
    """
    return x.index_select(0, plan.token_index)  # (M, H)


def unpermute(
    y: torch.Tensor, plan: PermutePlan, weights: torch.Tensor, out_shape: Optional[torch.Size] = None
) -> torch.Tensor:
    """Weight expert outputs and sum them back per token: ``(M, H) -> (N, H)``. Differentiable.

    Dropped assignments contribute zero. Contributions to a token are added in ascending expert order.

    Args:
        y: ``(M, H)`` expert outputs in plan order.
        plan: the plan that produced the order.
        weights: ``(N, k)`` router weights.
        out_shape: shape of the result (``N·H`` elements, e.g. ``(B, T, H)``); the result is a fresh
            tensor of that shape, not a view.

    Example:
        >>> plan = make_permutation(torch.tensor([[0, 1]]), 2)
        >>> unpermute(torch.tensor([[1.0], [2.0]]), plan, torch.tensor([[0.5, 0.25]])).tolist()
        [[1.0]]
    """
    w = weights.reshape(-1).index_select(0, plan.slot_index)  # (M,)
    out = y.new_zeros(out_shape if out_shape is not None else (plan.num_tokens, y.shape[-1]))  # (N, H) or (B, T, H)
    out.view(plan.num_tokens, y.shape[-1]).index_add_(0, plan.token_index, y * w.unsqueeze(-1).to(y.dtype))
    return out


def split_sizes(tokens_per_expert: torch.Tensor, ep: int) -> torch.Tensor:
    """Rows sent to each of ``ep`` ranks when experts are laid out in ``ep`` equal contiguous blocks.

    Example:
        >>> split_sizes(torch.tensor([1, 2, 3, 4]), ep=2).tolist()
        [3, 7]
    """
    e = tokens_per_expert.numel()
    if e % ep:
        raise ValueError(f"num_experts={e} is not divisible by ep={ep}; every ep rank must hold E/ep experts")
    return tokens_per_expert.reshape(ep, e // ep).sum(1)  # (ep,)


def regroup_by_expert(counts: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
    """Permutation from source-major to expert-major order of received rows.

    After the dispatch all-to-all a rank holds rows ordered ``(source rank s, local expert j)``
    with ``counts[s, j]`` rows per block. ``received[perm]`` orders them ``(j, s)`` so that each
    local expert's rows are contiguous (``perm`` has shape ``(counts.sum(),)``). ``total``: that sum, when the
    caller knows it on the host (the dispatch does); otherwise it is read from ``counts`` (a host sync on a GPU).

    Example:
        >>> regroup_by_expert(torch.tensor([[1, 2], [1, 1]])).tolist()  # rows: s0j0 s0j1 s0j1 s1j0 s1j1
        [0, 3, 1, 2, 4]
    """
    sizes = counts.reshape(-1)  # (S·J,) source-major block sizes
    starts = (torch.cumsum(sizes, 0) - sizes).reshape(counts.shape)  # (S, J)
    sizes_t = counts.t().reshape(-1)  # (J·S,) expert-major
    starts_t = starts.t().reshape(-1)
    total = int(sizes.sum()) if total is None else total
    out_starts = torch.cumsum(sizes_t, 0) - sizes_t  # (J·S,)
    pos = torch.arange(total, device=counts.device)
    return torch.repeat_interleave(starts_t - out_starts, sizes_t, output_size=total) + pos


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``, so ``x[perm][inv] == x``.

    Example:
        >>> inverse_permutation(torch.tensor([2, 0, 1])).tolist()
        [1, 2, 0]
    """
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv
