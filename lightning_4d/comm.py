"""Count every collective actually issued: kind, mesh axis, calls and bytes.

``CommCounter`` is a ``TorchDispatchMode`` that sees the functional collectives DTensor, FSDP2 and
autograd-aware all-to-alls issue (and the in-place ``c10d`` ones), in forward and backward. For
each it records the full tensor size ``S`` and the bytes each rank sends by the ring formulas:
all-reduce ``2(n−1)/n·S``, all-gather / reduce-scatter / all-to-all ``(n−1)/n·S``.

Example:
    >>> with CommCounter(axis_names={}) as counter:  # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    >>> counter.totals()[("tp", "all_reduce")]  # doctest: +SKIP
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_4d import _compat

__all__ = ["CommCounter", "CommRecord", "wire_bytes", "axis_names_for"]

_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


def wire_bytes(kind: str, full_bytes: float, n: int) -> float:
    """Bytes one rank sends for a collective over ``n`` ranks on a tensor of ``full_bytes``.

    Example:
        >>> wire_bytes("all_reduce", 100, 2), wire_bytes("all_gather", 100, 2)
        (100.0, 50.0)
    """
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * full_bytes
    return (n - 1) / n * full_bytes


@dataclass
class CommRecord:
    """One collective: kind, mesh axis, group size, full tensor bytes, backward or not."""

    kind: str
    axis: str
    group_size: int
    full_bytes: int
    backward: bool

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends (ring formulas)."""
        return wire_bytes(self.kind, self.full_bytes, self.group_size)


def axis_names_for(mesh: Any) -> dict[str, str]:
    """Map process-group names to mesh axis names for a ``FourDMesh``.

    Example:
        >>> axis_names_for(None)
        {}
    """
    if mesh is None:
        return {}
    names: dict[str, str] = {}
    # Axes over identical ranks may share one group: the dense axis name wins.
    for axis in ("tp", "dp", "pp", "ep", "edp"):
        try:
            names.setdefault(mesh[axis].get_group().group_name, axis)
        except Exception:  # noqa: BLE001 - an axis of size 1 may have no group
            continue
    return names


def _group_info(func_name: str, args: tuple, kwargs: dict) -> tuple[Optional[str], int]:
    for arg in list(args) + list(kwargs.values()):
        pg = _compat.process_group_of(arg)
        if pg is None:
            continue
        try:
            return pg.group_name, pg.size()
        except Exception:  # noqa: BLE001
            continue
    return None, 1


class CommCounter(_compat.dispatch_mode_base()):  # type: ignore[misc]
    """Records collectives issued while active (forward and backward).

    Args:
        axis_names: process-group name → axis name (see :func:`axis_names_for`).

    Example:
        >>> counter = CommCounter({})
        >>> counter.records
        []
    """

    def __init__(self, axis_names: dict[str, str]) -> None:
        super().__init__()
        self.axis_names = axis_names
        self.records: list[CommRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _compat.is_higher_order_op(func):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(t is DTensor or (isinstance(t, type) and issubclass(t, DTensor)) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first, then see those
        out = func(*args, **kwargs)
        name = _compat.op_name(func)
        kind = _KINDS.get(name)
        if kind is not None:
            group, size = _group_info(name, args, kwargs)
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if isinstance(tensor, (list, tuple)):
                tensor = tensor[0]
            nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
            if kind == "all_gather":
                nbytes *= size  # S is the gathered (output) size
            axis = self.axis_names.get(group or "", group or "?")
            self.records.append(CommRecord(kind, axis, size, nbytes, _compat.in_backward()))
        return out

    def totals(self, backward: Optional[bool] = None) -> dict[tuple[str, str], dict[str, float]]:
        """``{(axis, kind): {"count", "full_bytes", "sent_bytes"}}``, optionally forward- or backward-only."""
        out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"count": 0, "full_bytes": 0, "sent_bytes": 0.0})
        for r in self.records:
            if backward is not None and r.backward != backward:
                continue
            entry = out[(r.axis, r.kind)]
            entry["count"] += 1
            entry["full_bytes"] += r.full_bytes
            entry["sent_bytes"] += r.sent_bytes
        return dict(out)
