"""Small collective helpers: sums, module-state broadcast, the global gradient norm.

Example:
    >>> import torch
    >>> all_reduce_sum(torch.ones(1)).item()  # a no-op without a process group
    1.0
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_4d import _compat

__all__ = ["all_reduce_coalesced", "all_reduce_sum", "broadcast_module_state", "connect", "global_grad_norm",
           "grad_norm_share", "is_on_meta", "local_of", "reduce_tensor", "to_full"]


_DESTROY_AT_EXIT: list[bool] = []  # the exit hook is registered once per process


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def connect(cluster_environment: Any, backend: str, timeout: Any, device: torch.device) -> bool:
    """Initialise the default process group through Lightning (an existing one is reused); returns whether it was
    made here. A group made here is destroyed at the process's exit, on every rank (NCCL warns of, and may hang on,
    one left alive), not at the strategy's teardown: ``trainer.validate`` after ``trainer.fit`` still uses it.

    Example:
        >>> # not run: needs a process group
        >>> connect(LightningEnvironment(), "gloo", timedelta(minutes=5), torch.device("cpu"))  # doctest: +SKIP
        True
    """
    import atexit

    made = not dist.is_initialized()
    _compat.init_dist_connection(cluster_environment, backend, timeout, device)
    if made and not _DESTROY_AT_EXIT:
        _DESTROY_AT_EXIT.append(True)
        atexit.register(_destroy_default_group)
    return made


def all_reduce_sum(tensor: Tensor, group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """Sum ``tensor`` in place over ``group`` (identity without a process group).

    Example:
        >>> all_reduce_sum(torch.tensor([2.0]))
        tensor([2.])
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def reduce_tensor(tensor: Tensor, group: Optional[dist.ProcessGroup] = None,
                  reduce_op: Optional[Union[str, dist.ReduceOp]] = "mean") -> Tensor:
    """A reduced copy of ``tensor`` over ``group`` (default: the world): ``"mean"`` (``"avg"``; in float32),
    ``"sum"``, ``"max"`` or ``"min"``; ``tensor`` itself without a process group. What both strategies' ``reduce`` /
    ``all_reduce`` do (tp/pp peers hold equal values, so the world mean is the data-parallel mean).

    Example:
        >>> reduce_tensor(torch.tensor([2.0]), reduce_op="sum")  # no process group: unchanged
        tensor([2.])
    """
    if not dist.is_initialized():
        return tensor
    # ReduceOp members print as e.g. "RedOpType.SUM" (torch 2.13) or "ReduceOp.SUM": keep the name.
    op = str(reduce_op).lower().rsplit(".", 1)[-1] if reduce_op is not None else "sum"
    out = tensor.detach().clone() if not tensor.is_floating_point() else tensor.clone()
    if op in ("mean", "avg"):
        out = all_reduce_sum(out.float(), group) / dist.get_world_size(group)
    elif op == "sum":
        out = all_reduce_sum(out, group)
    elif op == "max":
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    elif op == "min":
        dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group)
    else:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported; use 'mean', 'sum', 'max' or 'min'.")
    return out


@torch.no_grad()
def all_reduce_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` in place over ``group``: one all-reduce per ``(device, dtype)`` of their concatenation.

    Example:
        >>> # not run: needs a process group
        >>> all_reduce_coalesced([router.weight.grad, shared.w1.weight.grad], mesh["tp"].get_group())  # doctest: +SKIP
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for bucket in buckets.values():
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.all_reduce(bucket[0], group=group)
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])  # (Σ numel,)
        dist.all_reduce(flat, group=group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))


@torch.no_grad()
def broadcast_module_state(module: nn.Module, src: int = 0, bucket_bytes: int = 64 << 20) -> None:
    """Broadcast every full (non-DTensor) parameter and buffer from global rank ``src``.

    Called before sharding a model built for real, so all ranks start from identical weights even if they were
    initialised from different random states. Tensors are packed per dtype into buckets of at most
    ``bucket_bytes`` (a larger tensor goes alone), so the extra memory is one bucket, never a copy of the model.

    Example:
        >>> broadcast_module_state(nn.Linear(2, 2))  # no-op without a process group
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if not t.is_meta]
    by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    for group in by_dtype.values():
        bucket: list[Tensor] = []
        size = 0
        for t in group + [None]:  # type: ignore[list-item]
            nbytes = 0 if t is None else t.numel() * t.element_size()
            if bucket and (t is None or size + nbytes > bucket_bytes):
                _broadcast_bucket(bucket, src)
                bucket, size = [], 0
            if t is not None:
                bucket.append(t)
                size += nbytes


@torch.no_grad()
def _broadcast_bucket(bucket: list[Tensor], src: int) -> None:
    if len(bucket) == 1:
        t = bucket[0]
        if t.is_contiguous():
            dist.broadcast(t.data, src)
            return
    flat = torch.cat([t.detach().reshape(-1) for t in bucket])
    dist.broadcast(flat, src)
    offset = 0
    for t in bucket:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _local_norm_pow(grads: list[Tensor], norm_type: float) -> Tensor:
    norms = _compat.foreach_norm(grads, norm_type)
    return torch.stack([n.float() for n in norms]).pow(norm_type).sum()


def grad_norm_share(params: Iterable[nn.Parameter], norm_type: float = 2.0, pp: int = 1,
                    group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """This rank's share of the ``norm_type``-th power of the global gradient norm: a device scalar that, summed
    over ``group`` (default: the world), gives ``‖g‖^p`` with every distinct shard counted once. No host sync; a
    collective only to resolve ``Partial`` gradients.

    Each rank sums the ``p``-th powers of its *local* gradient shards, weighted so that the sum over ``group``
    counts every distinct shard once: a parameter of one pipeline rank is held by ``world / pp`` ranks; a DTensor
    gradient has ``Π size(d)`` distinct shards over its ``Shard`` mesh dimensions (replicas on ``Replicate``
    dimensions or outside its mesh share the weight), a plain gradient one (identical on every rank of its stage).
    Tied copies must be left out by the caller.

    Example:
        >>> lin = nn.Linear(2, 1); lin(torch.ones(1, 2)).sum().backward()
        >>> round(float(grad_norm_share(lin.parameters())), 4)  # 1² + 1² + 1²
        3.0
    """
    if norm_type == float("inf"):
        raise ValueError("norm_type=inf is not supported for global clipping; use 2.0.")
    from torch.distributed.tensor import DTensor, Replicate

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    holders = world // pp  # ranks holding a shard or a copy of each parameter
    weighted: dict[float, list[Tensor]] = defaultdict(list)  # weight -> local gradient tensors
    device: Optional[torch.device] = None  # the parameters' (a rank without gradients still all-reduces there)
    for p in params:
        g = p.grad
        device = device or p.device
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
            # Every placement that is neither Replicate nor Partial splits the tensor (Shard, _StridedShard).
            shards = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements)
                               if not (pl.is_replicate() or pl.is_partial()))
            weighted[shards / holders].append(g.to_local())
        else:
            weighted[1.0 / holders].append(g)
        device = g.device
    total = torch.zeros((), dtype=torch.float32, device=device or "cpu")
    for weight, grads in weighted.items():
        total = total + weight * _local_norm_pow(grads, norm_type).to(device)
    return total


def global_grad_norm(params: Iterable[nn.Parameter], norm_type: float = 2.0, pp: int = 1,
                     group: Optional[dist.ProcessGroup] = None, share: Optional[Tensor] = None) -> Tensor:
    """The norm of all gradients of the model across every shard, equal on every rank: one scalar all-reduce of
    :func:`grad_norm_share` (or of ``share``, that function's result computed earlier for the same gradients),
    which replaces one redistribution per parameter and mesh dimension. A device scalar: nothing is read on the
    host.

    Example:
        >>> lin = nn.Linear(2, 1); lin(torch.ones(1, 2)).sum().backward()
        >>> round(float(global_grad_norm(lin.parameters())), 4)
        1.7321
    """
    total = (share if share is not None else grad_norm_share(params, norm_type, pp, group)).clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        all_reduce_sum(total, group)
    return total.pow(1.0 / norm_type)


def local_of(tensor: Any) -> Any:
    """This rank's local tensor: a DTensor's shard (differentiable), a plain tensor (or ``None``) itself; the one
    owner of "DTensor to local" for the package.

    Example:
        >>> local_of(torch.ones(2)).shape, local_of(None)
        (torch.Size([2]), None)
    """
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def is_on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (built without weights): the one
    definition the package uses (set-up, value checks, tracing).

    Example:
        >>> is_on_meta(nn.Linear(1, 1)), is_on_meta(nn.Linear(1, 1, device="meta"))
        (False, True)
    """
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


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
