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
(:class:`lightning_4d.callbacks.CommRecorder`) subclass this one; every one names a call's process group with
:func:`axis_of_group` (mesh axes from :func:`mesh_axis_groups`, ties broken by :func:`name_axis`).

Example:
    >>> # not run: needs a process group
    >>> with CommCounter(mesh_axis_groups(mesh)) as counter:  # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    >>> counter.totals()[("tp", "all_reduce")]  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from lightning_4d import _compat

if TYPE_CHECKING:
    import torch.distributed as dist
    from lightning_4d._compat.dispatch import OperatorBase
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_4d.mesh import FourDMesh

__all__ = ["internal_comm", "is_internal_comm", "CommCounter", "CommRecord", "KIND_OF_OP", "wire_bytes", "full_bytes", "op_bytes", "AXIS_ORDER",
           "axis_of_group", "mesh_axis_groups", "name_axis"]

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


def _nbytes(t: object) -> int:
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


#: Which of several mesh axes spanning the same ranks (one process group) names a collective on it: an all-to-all
#: is expert traffic and takes ``ep``, then ``edp``; any other kind the first of :data:`AXIS_ORDER` (dense axes
#: before expert ones). Every recorder and the dry run's formulas name groups with :func:`name_axis`.
AXIS_ORDER = ("tp", "cp", "dp", "dp_cp", "dp_shard", "dp_replicate", "pp", "ep", "edp")
_PREFERRED_BY_KIND = {"all_to_all": ("ep", "edp")}


def name_axis(axes: Sequence[str], kind: Optional[str] = None) -> str:
    """The one tie-break: the axis that names a ``kind`` collective on a group that ``axes`` all span.

    Example:
        >>> name_axis(("tp", "ep"), "all_reduce"), name_axis(("tp", "ep"), "all_to_all"), name_axis(("edp", "dp"))
        ('tp', 'ep', 'dp')
    """
    for preferred in _PREFERRED_BY_KIND.get(kind or "", ()):
        if preferred in axes:
            return preferred
    return min(axes, key=lambda a: AXIS_ORDER.index(a) if a in AXIS_ORDER else len(AXIS_ORDER))


def _named_meshes(mesh: Union[FourDMesh, DeviceMesh, Mapping[str, Union[FourDMesh, DeviceMesh]], None]
                  ) -> list[tuple[str, DeviceMesh]]:
    """``(axis, 1-D mesh)`` of a ``FourDMesh`` (HSDP's flattened ``dp`` and context parallelism's ``dp_cp`` too), a
    ``DeviceMesh`` or a dict of them."""
    if mesh is None:
        return []
    if isinstance(mesh, Mapping):
        return [pair for m in mesh.values() for pair in _named_meshes(m)]
    if hasattr(mesh, "dense") and hasattr(mesh, "expert"):  # a lightning_4d FourDMesh
        flat = [("dp", mesh.flat_dp)] if getattr(mesh, "flat_dp", None) is not None else []
        flat += [("dp_cp", mesh.dp_cp)] if getattr(mesh, "dp_cp", None) is not None else []  # context parallel
        return flat + _named_meshes(mesh.dense) + _named_meshes(mesh.expert)
    return [(dim, mesh[dim]) for dim in (mesh.mesh_dim_names or ())]


def _ranks(pg: dist.ProcessGroup) -> Optional[tuple[int, ...]]:
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a group this process does not know by ranks: matched by name only
        return None


def mesh_axis_groups(mesh: Union[FourDMesh, DeviceMesh, Mapping[str, Union[FourDMesh, DeviceMesh]], None]
                     ) -> dict[Union[str, tuple[int, ...]], tuple[str, ...]]:
    """Mesh axes per process group, keyed by group name and, for groups of several ranks, by the tuple of their
    global ranks (torch may hand DTensor an equal group under another name: ``DeviceMesh`` caches sub-meshes).
    ``mesh``: a ``FourDMesh``, a ``DeviceMesh``, a dict of them, or ``None``.

    Example:
        >>> mesh_axis_groups(None)
        {}
    """
    out: dict[Union[str, tuple[int, ...]], list[str]] = defaultdict(list)
    for axis, sub in _named_meshes(mesh):
        group = sub.get_group()
        keys = [group.group_name]
        ranks = _ranks(group) if sub.size() > 1 else None
        keys += [ranks] if ranks is not None else []
        for key in keys:
            if axis not in out[key]:
                out[key].append(axis)
    return {k: tuple(v) for k, v in out.items()}


def axis_of_group(pg: Optional[dist.ProcessGroup], kind: str,
                  groups: Mapping[Union[str, tuple[int, ...]], Sequence[str]]) -> str:
    """The mesh axis a ``kind`` collective on process group ``pg`` is counted under (``groups``:
    :func:`mesh_axis_groups`): :func:`name_axis` of the axes spanning it, else ``"world"`` for the default
    group and ``"other"``.

    Example:
        >>> axis_of_group(None, "all_reduce", {})
        'other'
    """
    import torch.distributed as dist

    if pg is None:
        return "other"
    axes = groups.get(pg.group_name)
    if not axes and groups:
        axes = groups.get(_ranks(pg))
    if axes:
        return name_axis(axes, kind)
    try:
        if dist.is_initialized() and pg.group_name == dist.group.WORLD.group_name:
            return "world"
    except Exception:  # noqa: BLE001 - no default group to compare with
        pass
    return "other"


class CommCounter(_compat.dispatch_mode_base()):  # type: ignore[misc]
    """Records every collective issued while active (forward and backward) as :class:`CommRecord`.

    Args:
        groups: process-group name or ranks → mesh axes (:func:`mesh_axis_groups`); a call is counted under
            :func:`axis_of_group` (the package's one namer).

    Subclasses skip calls (:meth:`skip`) or follow the call's handle (:meth:`issued`).

    Example:
        >>> with CommCounter({}) as counter:
        ...     _ = torch.ones(2) + 1
        >>> counter.records, counter.totals()
        ([], {})
    """

    def __init__(self, groups: Optional[Mapping[Union[str, tuple[int, ...]], Sequence[str]]] = None) -> None:
        super().__init__()
        self.groups = dict(groups or {})
        self.records: list[CommRecord] = []
        self._groups: dict[str, Optional[dist.ProcessGroup]] = {}  # group name argument → ProcessGroup
        self._axes: dict[tuple[str, str], str] = {}  # (group name, kind) → axis

    def axis(self, pg: Optional[dist.ProcessGroup], kind: str) -> tuple[str, int]:
        """Axis name (:func:`axis_of_group`) and group size of a call on process group ``pg`` (``None``: none)."""
        if pg is None:
            return axis_of_group(None, kind, self.groups), 1
        key = (pg.group_name, kind)
        if key not in self._axes:
            self._axes[key] = axis_of_group(pg, kind, self.groups)
        return self._axes[key], int(pg.size())

    def skip(self) -> bool:
        """Whether to leave the current call unrecorded."""
        return False

    def issued(self, record: CommRecord, namespace: str, out: Any) -> None:
        """Called with each new record and the op's output (e.g. to time the wait on its handle)."""

    def _group(self, args: tuple, kwargs: dict) -> Optional[dist.ProcessGroup]:
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

    def __torch_dispatch__(self, func: OperatorBase, types: tuple[type, ...], args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
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
