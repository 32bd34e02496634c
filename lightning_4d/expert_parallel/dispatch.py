"""All-to-all token dispatch and combine for expert parallelism, with autograd.

The collective is the public ``torch.distributed.all_to_all_single`` (uneven split sizes work on
gloo/CPU and NCCL) wrapped in a small autograd Function whose backward is the reverse all-to-all.
``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated in this torch
(it points to the private ``_functional_collectives``), so it is not used.

Traffic is counted by the package's one recorder, :class:`lightning_4d.core.comm.CommCounter` (a dispatch mode
that sees these ``c10d`` all-to-alls like every other collective); the names are re-exported here.

Example:
    >>> # not run: needs a process group
    >>> with CommCounter(mesh_axis_groups(mesh)) as counter:  # doctest: +SKIP
    ...     recv, info = dispatch(xs, plan.tokens_per_expert, ep_group)   # (R, H)
    ...     back = combine(experts(recv), info)                           # (M, H)
    >>> counter.counts()["ep"]  # doctest: +SKIP
    {'all_to_all': 3}
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_4d.core.comm import CommCounter, CommRecord
from lightning_4d.expert_parallel.permute import FIXED_ROUTING, inverse_permutation, regroup_by_expert, split_sizes

__all__ = ["CommRecord", "CommCounter", "all_to_all", "all_reduce_", "DispatchInfo", "dispatch", "combine"]


def _a2a_raw(
    x: torch.Tensor, output_splits: Optional[list[int]], input_splits: Optional[list[int]], group: dist.ProcessGroup
) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x) if output_splits is None else x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):  # type: ignore[override]
        ctx.meta = (output_splits, input_splits, group)
        return _a2a_raw(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        output_splits, input_splits, group = ctx.meta
        return _a2a_raw(grad, input_splits, output_splits, group), None, None, None


def all_to_all(
    x: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0; the backward is the reverse all-to-all.

    Args:
        x: ``(sum(input_splits), ...)`` rows to send, rank ``r``'s rows contiguous.
        output_splits: rows received from each rank.
        input_splits: rows sent to each rank.
        group: the process group.

    Example:
        >>> # not run: needs a process group
        >>> y = all_to_all(x, [2, 1], [1, 2], group)  # doctest: +SKIP
    """
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """In-place SUM all-reduce without autograd (nothing over one rank).

    Example:
        >>> # not run: needs a process group
        >>> all_reduce_(counts, ep_group)  # doctest: +SKIP
    """
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


@dataclass(frozen=True)
class DispatchInfo:
    """What :func:`combine` needs to send expert outputs back (returned by :func:`dispatch`).

    Attributes:
        counts: ``(ep, E_local)`` rows received from source rank ``s`` for local expert ``j``.
        tokens_per_local_expert: ``(E_local,)`` rows per local expert after regrouping.
        input_splits / output_splits: rows sent to / received from each rank in the dispatch.
        perm: ``(R,)`` source-major -> expert-major order of the received rows.
        host_tokens_per_local_expert: ``tokens_per_local_expert`` on the host (read in the dispatch's one host copy),
            for expert code that needs the counts there (a per-expert loop) without another sync.
    """

    group: dist.ProcessGroup
    counts: torch.Tensor
    tokens_per_local_expert: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    perm: torch.Tensor
    host_tokens_per_local_expert: Optional[list[int]] = None


def dispatch(
    xs: torch.Tensor, tokens_per_expert: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, DispatchInfo]:
    """Send expert-sorted rows to the ranks that own their experts and regroup them by local expert.

    Rank ``r`` of the ``ep`` group owns experts ``[r·E/ep, (r+1)·E/ep)``. Issues one small
    all-to-all of the per-expert counts and one of the rows; the split sizes reach the host in one copy (the
    layer's one host sync, as in TorchTitan and Megatron). Under a :class:`~.permute.FixedRouting` the
    counts and split sizes are host values computed in its ``host`` context, and the counts received are
    known (every rank routes alike: rank ``s`` sends this rank what it sends itself); the counts
    all-to-all is still issued, as in training.

    Args:
        xs: ``(M, H)`` rows sorted by global expert id (see :func:`~.permute.make_permutation`).
        tokens_per_expert: ``(E,)`` rows per global expert in ``xs``.
        group: the expert-parallel process group.

    Returns:
        ``(recv, info)``: ``recv`` is ``(R, H)`` sorted by local expert; ``info`` feeds :func:`combine`.

    Example:
        >>> # not run: needs a process group
        >>> recv, info = dispatch(xs, plan.tokens_per_expert, mesh["ep"].get_group())  # doctest: +SKIP
    """
    ep = dist.get_world_size(group)
    num_experts = tokens_per_expert.numel()
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}; choose ep dividing num_experts")
    e_local = num_experts // ep
    fixed = FIXED_ROUTING.get()
    with fixed.host() if fixed is not None else contextlib.nullcontext():
        send_counts = tokens_per_expert.to(torch.long)  # (E,) = (ep, E_local) destination-major
        counts = _a2a_raw(send_counts, None, None, group).view(ep, e_local)  # (ep, E_local)
        if fixed is not None:
            counts = send_counts.view(ep, e_local)[dist.get_rank(group)].repeat(ep, 1)  # (ep, E_local)
        # The layer's one host sync: rows sent per rank and the received counts, in one copy.
        host = torch.cat([split_sizes(send_counts, ep), counts.reshape(-1)]).tolist()  # (ep + ep·E_local,)
        input_splits, received = host[:ep], host[ep:]
        output_splits = [sum(received[s * e_local:(s + 1) * e_local]) for s in range(ep)]
        local_counts = [sum(received[j::e_local]) for j in range(e_local)]
        recv = all_to_all(xs, output_splits, input_splits, group)  # (R, H) source-major
        perm = regroup_by_expert(counts, total=sum(output_splits))  # (R,)
        info = DispatchInfo(group, counts, counts.sum(0), input_splits, output_splits, perm, local_counts)
        return recv.index_select(0, perm), info  # (R, H) expert-major


def combine(y: torch.Tensor, info: DispatchInfo) -> torch.Tensor:
    """Return expert outputs ``(R, H)`` (expert-major) to their source ranks: ``-> (M, H)`` in the
    order the rows had before :func:`dispatch`. One all-to-all.

    Example:
        >>> # not run: needs a process group
        >>> back = combine(recv * 2, info)  # doctest: +SKIP
    """
    y_src = y.index_select(0, inverse_permutation(info.perm))  # (R, H) source-major
    return all_to_all(y_src, info.input_splits, info.output_splits, info.group)
