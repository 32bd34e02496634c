"""Optimizer parameter groups for sharded models: one group per ``(device mesh, placements)``.

After ``FourDStrategy`` set the model up its parameters are DTensors on several meshes (the dense ``tp`` / ``dp``
meshes, the experts' ``ep`` / ``edp`` view) next to plain tensors. torch's ``foreach`` and ``fused`` optimizer
kernels take one list of tensors per call, and a DTensor list must share one mesh (mixing meshes fails inside the
op). Split the parameters with :func:`mesh_param_groups` and the fast kernels apply: each group is one ``foreach`` /
``fused`` call instead of about a dozen kernels (each a DTensor dispatch) per parameter with ``foreach=False``.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    >>> groups = mesh_param_groups(model.parameters(), weight_decay=0.1)
    >>> [(len(g["params"]), g["weight_decay"]) for g in groups]  # plain tensors on one device: one group
    [(4, 0.1)]
    >>> opt = torch.optim.AdamW(groups, lr=1e-3, foreach=True)
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Mapping, Union

import torch
from torch import nn

from lightning_4d import _compat

__all__ = ["mesh_param_groups", "group_key", "fast_kernel"]

ParamsOrGroups = Union[Iterable[nn.Parameter], Iterable[Mapping[str, Any]]]


def group_key(p: torch.Tensor) -> Hashable:
    """What a parameter must share with the others of its ``foreach`` / ``fused`` call: its DeviceMesh and placements
    (a DTensor), else its device (a plain tensor).

    Example:
        >>> group_key(torch.zeros(1))
        ('tensor', device(type='cpu'))
    """
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return ("dtensor", p.device_mesh, tuple(p.placements))
    return ("tensor", p.device)


def mesh_param_groups(params: ParamsOrGroups, **options: Any) -> list[dict[str, Any]]:
    """Split ``params`` into optimizer parameter groups of one ``(device mesh, placements)`` each (plain tensors: one
    device each), in order of first appearance; pass the result to any ``torch.optim`` optimizer with
    ``foreach=True`` or ``fused=True``.

    Args:
        params: parameters (e.g. ``self.parameters()``), or parameter groups (dicts with ``"params"``): each group
            is split on its own and keeps its options (a weight-decay group stays one).
        **options: options set on every group that does not set them itself (``weight_decay=0.1``...).

    Returns:
        The groups, each ``{"params": [...], **options}``; a group's parameters all live on one mesh with the same
        placements. Every parameter appears once (duplicates, e.g. tied weights, are dropped after the first).

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> groups = mesh_param_groups([{"params": [lin.weight], "weight_decay": 0.1}, {"params": [lin.bias]}],
        ...                            weight_decay=0.0)
        >>> [g["weight_decay"] for g in groups]
        [0.1, 0.0]
    """
    items = list(params)
    groups_in = items if items and isinstance(items[0], Mapping) else [{"params": items}]
    seen: set[int] = set()
    out: list[dict[str, Any]] = []
    for group in groups_in:
        extra = {k: v for k, v in group.items() if k != "params"}
        members = group["params"]
        split: dict[Hashable, list[torch.Tensor]] = {}
        for p in [members] if isinstance(members, torch.Tensor) else members:
            if id(p) in seen:
                continue
            seen.add(id(p))
            split.setdefault(group_key(p), []).append(p)
        out += [{**options, **extra, "params": ps} for ps in split.values()]
    return out


def fast_kernel(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """The optimizer option for the fastest kernel every parameter allows: ``{"fused": True}`` where torch has fused
    kernels for all their devices and they are floating point, else ``{"foreach": True}``. Use it with
    :func:`mesh_param_groups` (a fused or foreach call takes one mesh).

    Example:
        >>> fast_kernel([torch.zeros(2)])
        {'fused': True}
    """
    devices = _compat.fused_optimizer_devices()
    ok = all(p.device.type in devices and torch.is_floating_point(p) for p in params)
    return {"fused": True} if ok else {"foreach": True}
