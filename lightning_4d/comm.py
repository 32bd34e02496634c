"""Record every collective actually issued: kind, mesh axis, group size and bytes — the one recorder.

:class:`CommCounter` is a ``TorchDispatchMode`` that sees the collectives DTensor (``_c10d_functional``,
``_dtensor``), FSDP2 / replicate and ``torch.distributed`` calls (in-place ``c10d`` ops: the MoE dispatch's
all-to-alls, pipeline sends / receives) issue, in forward, backward and the optimizer step. Per call it keeps
a :class:`CommRecord`: the full tensor size ``S`` (:func:`full_bytes`; all-gather: the gathered output) and
the bytes this rank sends by :func:`wire_bytes`, the one copy of the ring formulas: all-reduce
``2(n−1)/n·S``, all-gather / reduce-scatter / broadcast ``(n−1)/n·S``, all-to-all ``S`` minus the chunk
the rank keeps (``(n−1)/n·S`` for even splits), send / recv ``S``. The planner's formulas
(:func:`lightning_4d.planner.comm.collective_bytes`) use the same function; the fake-world recorder
(:class:`lightning_4d.planner.fake_world.CollectiveRecorder`) and the callbacks' timed recorder
(:class:`lightning_4d.callbacks.CommRecorder`) subclass this one and only name axes (and time calls) their way.

Example:
    >>> with CommCounter(axis_names={}) as counter:  # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    >>> counter.totals()[("tp", "all_reduce")]  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch

from lightning_4d import _compat

__all__ = ["internal_comm", "is_internal_comm", "CommCounter", "CommRecord", "KIND_OF_OP", "wire_bytes", "full_bytes", "op_bytes", "axis_names_for"]

#: Collective op name (namespaces ``c10d``, ``_c10d_functional``, ``_dtensor``) → kind.
KIND_OF_OP: dict[str, str] = {
    **dict.fromkeys(("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
                     "all_reduce_coalesced_"), "all_reduce"),
    **dict.fromkeys(("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                     "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
                    "all_gather"),
    **dict.fromkeys(("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                     "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"), "reduce_scatter"),
    **dict.fromkeys(("alltoall_base_", "alltoall_", "all_to_all_single", "shard_dim_alltoall"), "all_to_all"),
    "send": "send", "recv_": "recv", "recv_any_source_": "recv", "broadcast_": "broadcast", "broadcast": "broadcast",
}
_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")

_STATE = threading.local()


@contextlib.contextmanager
def internal_comm() -> Iterator[None]:
    """Mark collectives issued inside the block as the package's own bookkeeping (checks, monitors, guards),
    not training traffic: recorders that count the step's communication skip them.

    Example:
        >>> with internal_comm():
        ...     is_internal_comm()
        True
        >>> is_internal_comm()
        False
    """
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


def is_internal_comm() -> bool:
    """Whether the current thread is inside :func:`internal_comm`.

    Example:
        >>> is_internal_comm()
        False
    """
    return getattr(_STATE, "depth", 0) > 0


def wire_bytes(kind: str, full: float, n: int, kept: Optional[float] = None) -> float:
    """Bytes one rank sends (``recv``: receives) in a collective of ``kind`` over ``n`` ranks on a full
    tensor of ``full`` bytes; ``kept``: the all-to-all chunk the rank keeps (default ``full / n``).

    Example:
        >>> wire_bytes("all_reduce", 100, 2), wire_bytes("all_gather", 100, 2), wire_bytes("send", 10, 2)
        (100.0, 50.0, 10.0)
        >>> wire_bytes("all_to_all", 100, 2, kept=80)
        20.0
    """
    if kind in ("send", "recv"):
        return float(full)
    if n <= 1:
        return 0.0
    if kind == "all_to_all" and kept is not None:
        return float(full - kept)
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * full


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def full_bytes(name: str, kind: str, args: tuple, n: int) -> int:
    """``S`` of one call of op ``name`` with ``args``: all-gather the gathered output, reduce-scatter and
    all-to-all the input, the others the tensor.

    Example:
        >>> full_bytes("all_gather_into_tensor", "all_gather", (torch.zeros(4), 2, "g"), 2)
        32
    """
    if kind == "all_gather":
        if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):  # (output(s), input(s), ...)
            return _nbytes(args[0])
        # (outputs [[n]], inputs, ...) or functional (input(s), group_size, group_name)
        return _nbytes(args[1] if name in ("allgather_", "allgather_coalesced_") else args[0]) * n
    if kind in ("reduce_scatter", "all_to_all") and name.endswith("_"):
        return _nbytes(args[1])  # c10d: (output(s), input(s), ...)
    return _nbytes(args[0])


def op_bytes(name: str, kind: str, args: tuple, n: int, rank: int) -> float:
    """Bytes this rank sends (``recv``: receives) in one call of op ``name``, exact for uneven all-to-alls.

    Example:
        >>> op_bytes("all_reduce", "all_reduce", (torch.zeros(4),), 2, 0)
        16.0
    """
    full, kept = full_bytes(name, kind, args, n), None
    splits = {"alltoall_base_": 4, "all_to_all_single": 2}.get(name) if kind == "all_to_all" else None
    if splits is not None:  # (output, input, group, output_splits, input_splits) / (input, out_s, in_s, group)
        inp = args[1] if name == "alltoall_base_" else args[0]
        sizes = list(args[splits]) if len(args) > splits and args[splits] else []
        rows = inp.shape[0] if inp.dim() else 1
        own = int(sizes[rank]) if len(sizes) == n and 0 <= rank < n else rows / max(n, 1)
        kept = own * (full / rows) if rows else 0.0
    return wire_bytes(kind, full, n, kept)


@dataclass
class CommRecord:
    """One collective: kind, mesh axis, group size, full tensor bytes ``S``, bytes this rank sends
    (:func:`op_bytes`), issued in backward or not, host seconds in it (and its wait, where timed), op name.

    Example:
        >>> CommRecord("all_reduce", "tp", 2, 64, 64.0).sent_bytes
        64.0
    """

    kind: str
    axis: str
    group_size: int
    full_bytes: float
    sent_bytes: float
    backward: bool = False
    seconds: float = 0.0
    op: str = ""


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


class CommCounter(_compat.dispatch_mode_base()):  # type: ignore[misc]
    """Records every collective issued while active (forward and backward) as :class:`CommRecord`.

    Args:
        axis_names: process-group name → axis name (see :func:`axis_names_for`); other groups keep their name.

    Subclasses name axes their way (:meth:`axis`), skip calls (:meth:`skip`) or follow the call's handle
    (:meth:`issued`).

    Example:
        >>> with CommCounter({}) as counter:
        ...     _ = torch.ones(2) + 1
        >>> counter.records, counter.totals()
        ([], {})
    """

    def __init__(self, axis_names: Optional[Mapping[str, str]] = None) -> None:
        super().__init__()
        self.axis_names = dict(axis_names or {})
        self.records: list[CommRecord] = []
        self._groups: dict[str, Any] = {}  # group name argument → ProcessGroup

    def axis(self, pg: Any, kind: str) -> tuple[str, int]:
        """Axis name and group size of a call on process group ``pg`` (``None``: no group found)."""
        if pg is None:
            return "?", 1
        return self.axis_names.get(pg.group_name, pg.group_name), int(pg.size())

    def skip(self) -> bool:
        """Whether to leave the current call unrecorded."""
        return False

    def issued(self, record: CommRecord, namespace: str, out: Any) -> None:
        """Called with each new record and the op's output (e.g. to time the wait on its handle)."""

    def _group(self, args: tuple, kwargs: dict) -> Any:
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, str):
                if arg not in self._groups:
                    self._groups[arg] = _compat.process_group_of(arg)
                pg = self._groups[arg]
            elif isinstance(arg, torch.ScriptObject) or type(arg).__name__ == "ProcessGroup":
                pg = _compat.process_group_of(arg)
            else:
                continue
            if pg is not None:
                return pg
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _compat.is_higher_order_op(func):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(isinstance(t, type) and issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first, then see those
        name = _compat.op_name(func)
        namespace = getattr(func, "namespace", "")
        kind = KIND_OF_OP.get(name) if namespace in _NAMESPACES else None
        if kind is None or self.skip():
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - t0
        pg = self._group(args, kwargs)
        axis, n = self.axis(pg, kind)
        rank = int(pg.rank()) if pg is not None else 0
        record = CommRecord(kind, axis, n, full_bytes(name, kind, args, n), op_bytes(name, kind, args, n, rank),
                            _compat.in_backward(), seconds, name)
        self.records.append(record)
        self.issued(record, namespace, out)
        return out

    def totals(self, backward: Optional[bool] = None) -> dict[tuple[str, str], dict[str, float]]:
        """``{(axis, kind): {"count", "full_bytes", "sent_bytes", "seconds"}}``, optionally forward- or
        backward-only."""
        out: dict[tuple[str, str], dict[str, float]] = {}
        for r in self.records:
            if backward is None or r.backward == backward:
                e = out.setdefault((r.axis, r.kind), {"count": 0, "full_bytes": 0, "sent_bytes": 0.0, "seconds": 0.0})
                e["count"] += 1
                e["full_bytes"] += r.full_bytes
                e["sent_bytes"] += r.sent_bytes
                e["seconds"] += r.seconds
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        """Bytes sent per axis and kind (the shape of :func:`lightning_4d.planner.comm.summarize`)."""
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for r in self.records:
            if r.sent_bytes:
                out[r.axis][r.kind] = out[r.axis].get(r.kind, 0.0) + r.sent_bytes
        return dict(out)

    def counts(self) -> dict[str, dict[str, int]]:
        """Number of calls per axis and kind."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for r in self.records:
            out[r.axis][r.kind] = out[r.axis].get(r.kind, 0) + 1
        return dict(out)
