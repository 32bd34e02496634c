"""All-to-all token dispatch and combine for expert parallelism, with autograd and a traffic counter.

The collective is the public ``torch.distributed.all_to_all_single`` (uneven split sizes work on
gloo/CPU and NCCL) wrapped in a small autograd Function whose backward is the reverse all-to-all.
``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated in this torch
(it points to the private ``_functional_collectives``), so it is not used.

Every collective issued here is reported to the active :class:`CommCounter` context managers
(count and bytes per group label, operation and tag), so callbacks and tests can check traffic.

Example:
    >>> with CommCounter() as counter:  # doctest: +SKIP
    ...     recv, info = dispatch(xs, plan.tokens_per_expert, ep_group)   # (R, H)
    ...     back = combine(experts(recv), info)                           # (M, H)
    >>> counter.count(tag="dispatch")  # doctest: +SKIP
    1
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_4d.expert_parallel.permute import inverse_permutation, regroup_by_expert, split_sizes

__all__ = ["CommRecord", "CommCounter", "all_to_all", "all_reduce_", "DispatchInfo", "dispatch", "combine"]

_ACTIVE: list["CommCounter"] = []
_LOCK = threading.Lock()


@dataclass(frozen=True)
class CommRecord:
    """One collective call seen by a :class:`CommCounter`.

    Attributes:
        op: ``"all_to_all_single"`` or ``"all_reduce"``.
        group: the label of the process group (e.g. ``"ep"``).
        tag: what it was for (``"dispatch"``, ``"combine"``, ``"dispatch.backward"``, ``"counts"``, ...).
        bytes: size of this rank's send buffer.
        remote_bytes: bytes leaving this rank: the send buffer minus the chunk kept locally
            (all-to-all) or the ring estimate ``2(n-1)/n · S`` (all-reduce).
        group_size: ranks in the group.
    """

    op: str
    group: str
    tag: str
    bytes: int
    remote_bytes: int
    group_size: int


@dataclass
class CommCounter:
    """Context manager recording every collective issued by :mod:`lightning_4d.expert_parallel`.

    Counters nest; each active one sees every call (forward and backward) made while it is open.

    Example:
        >>> with CommCounter() as c:
        ...     pass
        >>> c.count(), c.bytes()
        (0, 0)
    """

    records: list[CommRecord] = field(default_factory=list)

    def __enter__(self) -> "CommCounter":
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            _ACTIVE.remove(self)

    def _select(self, op: Optional[str], group: Optional[str], tag: Optional[str]) -> list[CommRecord]:
        return [
            r for r in self.records
            if (op is None or r.op == op) and (group is None or r.group == group) and (tag is None or r.tag == tag)
        ]

    def count(self, op: Optional[str] = None, group: Optional[str] = None, tag: Optional[str] = None) -> int:
        """Number of matching calls (``None`` matches anything)."""
        return len(self._select(op, group, tag))

    def bytes(self, op: Optional[str] = None, group: Optional[str] = None, tag: Optional[str] = None) -> int:
        """Total send-buffer bytes of matching calls."""
        return sum(r.bytes for r in self._select(op, group, tag))

    def remote_bytes(self, op: Optional[str] = None, group: Optional[str] = None, tag: Optional[str] = None) -> int:
        """Total bytes that left this rank in matching calls."""
        return sum(r.remote_bytes for r in self._select(op, group, tag))

    def summary(self) -> dict[tuple[str, str], dict[str, int]]:
        """``{(group, op): {"count", "bytes", "remote_bytes"}}`` over all records."""
        out: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0, "remote_bytes": 0})
        for r in self.records:
            s = out[(r.group, r.op)]
            s["count"] += 1
            s["bytes"] += r.bytes
            s["remote_bytes"] += r.remote_bytes
        return dict(out)

    def reset(self) -> None:
        """Forget all records."""
        self.records.clear()


def _record(op: str, group: str, tag: str, nbytes: int, remote: int, size: int) -> None:
    if not _ACTIVE:
        return
    rec = CommRecord(op, group, tag, int(nbytes), int(remote), size)
    with _LOCK:
        for counter in _ACTIVE:
            counter.records.append(rec)


def _a2a_raw(
    x: torch.Tensor, output_splits: Optional[list[int]], input_splits: Optional[list[int]],
    group: dist.ProcessGroup, label: str, tag: str,
) -> torch.Tensor:
    n = dist.get_world_size(group)
    x = x.contiguous()
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row (x may have no rows)
    if output_splits is None:
        out = torch.empty_like(x)
        own = x.shape[0] // n
    else:
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        own = input_splits[dist.get_rank(group)] if input_splits is not None else x.shape[0] // n
    _record("all_to_all_single", label, tag, x.numel() * x.element_size(), (x.shape[0] - own) * row, n)
    dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, label, tag):  # type: ignore[override]
        ctx.meta = (output_splits, input_splits, group, label, tag)
        return _a2a_raw(x, output_splits, input_splits, group, label, tag)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        output_splits, input_splits, group, label, tag = ctx.meta
        grad_in = _a2a_raw(grad, input_splits, output_splits, group, label, tag + ".backward")
        return grad_in, None, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: dist.ProcessGroup,
    *,
    label: str = "ep",
    tag: str = "all_to_all",
) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0; the backward is the reverse all-to-all.

    Args:
        x: ``(sum(input_splits), ...)`` rows to send, rank ``r``'s rows contiguous.
        output_splits: rows received from each rank.
        input_splits: rows sent to each rank.
        group: the process group.
        label, tag: names under which :class:`CommCounter` records the call.

    Example:
        >>> y = all_to_all(x, [2, 1], [1, 2], group)  # doctest: +SKIP
    """
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group, label, tag)


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup, *, label: str, tag: str) -> torch.Tensor:
    """In-place SUM all-reduce without autograd, recorded by :class:`CommCounter`.

    Example:
        >>> all_reduce_(counts, ep_group, label="ep", tag="router_stats")  # doctest: +SKIP
    """
    n = dist.get_world_size(group)
    if n == 1:
        return t
    nbytes = t.numel() * t.element_size()
    _record("all_reduce", label, tag, nbytes, 2 * (n - 1) * nbytes // n, n)
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
    """

    group: dist.ProcessGroup
    label: str
    counts: torch.Tensor
    tokens_per_local_expert: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    perm: torch.Tensor


def dispatch(
    xs: torch.Tensor, tokens_per_expert: torch.Tensor, group: dist.ProcessGroup, *, label: str = "ep"
) -> tuple[torch.Tensor, DispatchInfo]:
    """Send expert-sorted rows to the ranks that own their experts and regroup them by local expert.

    Rank ``r`` of the ``ep`` group owns experts ``[r·E/ep, (r+1)·E/ep)``. Issues one small
    all-to-all of the per-expert counts (tag ``"counts"``) and one of the rows (tag ``"dispatch"``).

    Args:
        xs: ``(M, H)`` rows sorted by global expert id (see :func:`~.permute.make_permutation`).
        tokens_per_expert: ``(E,)`` rows per global expert in ``xs``.
        group: the expert-parallel process group.

    Returns:
        ``(recv, info)``: ``recv`` is ``(R, H)`` sorted by local expert; ``info`` feeds :func:`combine`.

    Example:
        >>> recv, info = dispatch(xs, plan.tokens_per_expert, mesh["ep"].get_group())  # doctest: +SKIP
    """
    ep = dist.get_world_size(group)
    num_experts = tokens_per_expert.numel()
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}; choose ep dividing num_experts")
    e_local = num_experts // ep
    send_counts = tokens_per_expert.to(torch.long)  # (E,) = (ep, E_local) destination-major
    counts = _a2a_raw(send_counts, None, None, group, label, "counts").view(ep, e_local)  # (ep, E_local)
    input_splits = split_sizes(send_counts, ep).tolist()
    output_splits = counts.sum(1).tolist()
    recv = all_to_all(xs, output_splits, input_splits, group, label=label, tag="dispatch")  # (R, H) source-major
    perm = regroup_by_expert(counts)  # (R,)
    info = DispatchInfo(group, label, counts, counts.sum(0), input_splits, output_splits, perm)
    return recv.index_select(0, perm), info  # (R, H) expert-major


def combine(y: torch.Tensor, info: DispatchInfo) -> torch.Tensor:
    """Return expert outputs ``(R, H)`` (expert-major) to their source ranks: ``-> (M, H)`` in the
    order the rows had before :func:`dispatch`. One all-to-all (tag ``"combine"``).

    Example:
        >>> back = combine(recv * 2, info)  # doctest: +SKIP
    """
    y_src = y.index_select(0, inverse_permutation(info.perm))  # (R, H) source-major
    return all_to_all(y_src, info.input_splits, info.output_splits, info.group, label=info.label, tag="combine")
