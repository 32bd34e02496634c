"""Fused projections with concatenated outputs (``q|k|v``, ``gate|up``) under tensor parallelism.

A contiguous column shard of a concatenated fused weight would give rank 0 all of ``q`` and part of
``k``. The rows (output features) are therefore permuted once, at sharding time, so that rank ``r``'s
contiguous shard holds ``q_r | k_r | v_r``: the model's own ``split(sizes)`` then cuts the local output
correctly once its size attributes are per-rank (done by the TP planner). The permutation depends on
``tp``, so it never reaches a file: checkpoints and exports store the user's own layout
(:func:`canonical_state` / :func:`sharded_state`), and resharding across layouts stays exact.

Example:
    >>> concat_permutation([4, 2, 2], tp=2)
    [0, 1, 4, 6, 2, 3, 5, 7]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["attach_plan", "concat_permutation", "inverse_permutation", "permutations_of",
           "canonical_state", "sharded_state", "canonical_tensor", "full_tensors"]

_PLAN = "_fourd_layout_plan"  # the LayoutPlan applied to a root module (lightning_4d.plan)


def concat_permutation(sizes: Sequence[int], tp: int) -> list[int]:
    """Row order putting every piece's ``r``-th ``1/tp`` slice into rank ``r``'s contiguous shard (pure).

    Raises:
        ValueError: when a piece does not divide by ``tp``.

    Example:
        >>> concat_permutation([2, 2], tp=2)
        [0, 2, 1, 3]
    """
    if any(s % tp for s in sizes):
        raise ValueError(f"fused projection pieces {list(sizes)} do not all divide by tp={tp}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    order: list[int] = []
    for r in range(tp):
        for start, size in zip(starts, sizes):
            chunk = size // tp
            order.extend(range(start + r * chunk, start + (r + 1) * chunk))
    return order


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    """``inv`` with ``inv[perm[i]] = i``.

    Example:
        >>> inverse_permutation([2, 0, 1])
        [1, 2, 0]
    """
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def attach_plan(root: nn.Module, plan: Any) -> None:
    """Remember the layout plan applied to ``root`` (a :class:`~lightning_4d.plan.LayoutPlan`): what
    materialisation, checkpoints and exports read the row permutations from (:func:`permutations_of`)."""
    root.__dict__[_PLAN] = plan


def permutations_of(root: nn.Module) -> dict[str, tuple[list[int], int]]:
    """``{fqn: (perm, dim)}`` of the permuted parameters ``root`` holds (empty for most models), read from the
    layout plan applied to it (:func:`attach_plan`); modules a pipeline split removed are left out.

    Example:
        >>> permutations_of(nn.Linear(2, 2))
        {}
    """
    tpl = getattr(root.__dict__.get(_PLAN), "tensor_parallel", None)
    if tpl is None:
        return {}
    held = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    return {fqn: (list(perm), int(dim)) for fqn, (perm, dim) in tpl.permutations.items() if fqn in held}


def _permute(value: torch.Tensor, index: Sequence[int], dim: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    idx = torch.tensor(list(index))
    if isinstance(value, DTensor):
        full = value.full_tensor()  # the permutation crosses shards: rebuild the global tensor
        return distribute_tensor(full.index_select(dim, idx.to(full.device)), value.device_mesh, value.placements)
    if isinstance(value, torch.Tensor):
        return value.index_select(dim, idx.to(value.device))
    return value


def canonical_tensor(value: torch.Tensor, perm: Sequence[int], dim: int) -> torch.Tensor:
    """A permuted parameter (or gradient, or optimizer state) in the user's own row order."""
    if not isinstance(value, torch.Tensor) or value.dim() <= dim or value.shape[dim] != len(perm):
        return value
    return _permute(value, inverse_permutation(perm), dim)


def _matches(key: str, fqn: str) -> bool:
    return key == fqn or key.endswith("." + fqn) or f".{fqn}." in f".{key}."


def _convert(state: dict[str, Any], perms: dict[str, tuple[list[int], int]], to_user: bool) -> dict[str, Any]:
    if not perms:
        return state
    out = dict(state)
    for key, value in state.items():
        for fqn, (perm, dim) in perms.items():
            if not _matches(key, fqn) or not isinstance(value, torch.Tensor) or value.dim() <= dim \
                    or value.shape[dim] != len(perm):
                continue
            out[key] = _permute(value, inverse_permutation(perm) if to_user else perm, dim)
    return out


def canonical_state(state: dict[str, Any], perms: dict[str, tuple[list[int], int]]) -> dict[str, Any]:
    """``state`` (model or flattened optimizer state dict) with permuted entries in the user's layout.

    Example:
        >>> canonical_state({"w": torch.arange(4.0)}, {"w": ([0, 2, 1, 3], 0)})["w"].tolist()
        [0.0, 2.0, 1.0, 3.0]
    """
    return _convert(state, perms, to_user=True)


def sharded_state(state: dict[str, Any], perms: dict[str, tuple[list[int], int]]) -> dict[str, Any]:
    """The inverse of :func:`canonical_state`: user layout back to the permuted, sharded order.

    Example:
        >>> sharded_state({"w": torch.arange(4.0)}, {"w": ([0, 2, 1, 3], 0)})["w"].tolist()
        [0.0, 2.0, 1.0, 3.0]
    """
    return _convert(state, perms, to_user=False)


def full_tensors(module: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of ``module`` as one full tensor in the user's own layout, by name
    (collective for DTensors: call on every rank). Parameters without a gradient are left out with
    ``grads=True``.

    Example:
        >>> sorted(full_tensors(nn.Linear(2, 2)))
        ['bias', 'weight']
    """
    perms = permutations_of(module)
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        value = p.grad if grads else p
        if value is None:
            continue
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if name in perms:
            value = canonical_tensor(value, *perms[name])
        out[name] = value.detach()
    return out
