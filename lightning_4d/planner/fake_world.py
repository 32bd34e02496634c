"""Full-scale dry runs in one process: torch's ``fake`` process group, meta/fake tensors, recorded collectives.

Findings (torch 2.13, CPU):

- ``dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=N)`` works in a single
  process for any ``N`` (256 and 1024 tried) and ``init_device_mesh("cpu", (pp, dp, tp))`` builds
  every sub-group at once (milliseconds). Collectives return immediately without touching data.
- A model built on the ``meta`` device takes DTensor ``parallelize_module`` plans (colwise / rowwise /
  sequence parallel, ``PrepareModuleInput``) and FSDP2 ``fully_shard`` over the ``dp`` sub-mesh, with
  the *per-rank* local shapes of rank ``r``. ``model.to_empty(device="cpu")`` inside a
  ``FakeTensorMode`` then gives fake parameters (no memory), and a forward + backward on fake inputs
  runs every DTensor redistribution and FSDP all-gather / reduce-scatter against the fake group.
- ``CommDebugMode`` counts those collectives per op (FSDP's appear as ``c10d._allgather_base_`` /
  ``c10d._reduce_scatter_base_``, DTensor's as ``c10d_functional.*``) but records no sizes or
  groups; :class:`CollectiveRecorder` (a ``TorchDispatchMode``) adds bytes and the mesh axis of each
  call, in the format of :func:`lightning_4d.planner.comm.summarize`, so analytic and traced bytes
  can be compared (see ``tests/unit/test_planner_fake.py``: the TP bytes agree exactly).
- Limits: MoE layers do not run under plain fake tensors, even without EP: counting tokens per expert
  (``aten.bincount``) has a data-dependent output shape (``DynamicOutputShapeException``), and EP's
  all-to-all split sizes come from ``.tolist()`` on those counts. :mod:`lightning_4d.planner.dry_run`
  works around it with a uniform-routing stand-in (see there). Pipelining's point-to-point stages are
  not exercised (dry-run each stage's module per pp rank instead). The fake group gives no timing.

The private torch APIs this needs (``FakeStore``, which registers the ``fake`` backend;
``FakeTensorMode``; ``TorchDispatchMode``; ``ProcessGroup.unbox``, the group behind a ``c10d`` op's
script-object argument) are reached through :mod:`lightning_4d._compat`.

Example:
    >>> with fake_world(256, rank=3):  # doctest: +SKIP
    ...     mesh = init_device_mesh("cpu", (4, 8, 8), mesh_dim_names=("pp", "dp", "tp"))
    ...     with CollectiveRecorder(mesh) as rec:
    ...         fake_forward_backward(model, torch.randint(0, 1024, (2, 256)))
    ...     rec.summary()["tp"]
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from lightning_4d._compat import (
    dispatch_mode_base,
    fake_store,
    fake_tensor_mode,
    is_higher_order_op,
    op_name,
    process_group_of,
)
from lightning_4d.planner.comm import collective_bytes

__all__ = ["fake_world", "CollectiveRecorder", "TracedCollective", "fake_forward_backward"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make this process rank ``rank`` of a fake ``world_size``-rank default group; destroy it on exit.

    Refuses to run when a process group already exists (it would replace the real one).

    Example:
        >>> with fake_world(8, rank=1):
        ...     dist.get_world_size(), dist.get_rank()
        (8, 1)
        >>> dist.is_initialized()
        False
    """
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a default process group (one is initialised).")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, {world_size}).")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


_KINDS = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "shard_dim_alltoall": "all_to_all",
    "send": "send",
}


@dataclass(frozen=True)
class TracedCollective:
    """One traced call: ``size`` is the full tensor ``S`` in bytes (all-gather: the output)."""

    op: str
    kind: str
    axis: str
    group: int
    size: float

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sends (:func:`~lightning_4d.planner.comm.collective_bytes`)."""
        return collective_bytes(self.kind, self.group, self.size)


def _nbytes(x: Any) -> float:
    if isinstance(x, torch.Tensor):
        return float(x.numel() * x.element_size())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0.0


class CollectiveRecorder(dispatch_mode_base()):  # type: ignore[misc]
    """Record every ``c10d`` / ``c10d_functional`` collective with its bytes and mesh axis.

    ``mesh`` (a ``DeviceMesh`` with dim names, a dict of them, or a ``FourDMesh``) names the groups;
    others are labelled ``"group<N>"``. A group shared by several axes is named after the first.

    Example:
        >>> with fake_world(4):
        ...     with CollectiveRecorder() as rec:
        ...         _ = dist.all_reduce(torch.ones(8))
        >>> rec.summary()
        {'world': {'all_reduce': 48.0}}
    """

    def __init__(self, mesh: Any = None) -> None:
        super().__init__()
        self.records: list[TracedCollective] = []
        self._names: dict[str, tuple[str, int]] = {}
        if isinstance(mesh, dict):
            meshes = list(mesh.values())
        elif hasattr(mesh, "dense") and hasattr(mesh, "expert"):  # a lightning_4d FourDMesh
            meshes = [mesh.dense, mesh.expert]
        else:
            meshes = [mesh] if mesh is not None else []
        # A group shared by several axes (e.g. an axis spanning the whole world reuses the default group)
        # keeps the first name: dense axes before expert ones.
        for msh in meshes:
            for dim in msh.mesh_dim_names or ():
                sub = msh[dim]
                self._names.setdefault(sub.get_group().group_name, (dim, sub.size()))
        if dist.is_initialized():
            world = dist.group.WORLD
            self._names.setdefault(world.group_name, ("world", world.size()))

    def _axis(self, name: str, size: int) -> tuple[str, int]:
        return self._names.get(name, (f"group{name}", size))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if is_higher_order_op(func):
            return func(*args, **kwargs)
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # let DTensor desugar into collectives first (as CommDebugMode does)
        out = func(*args, **kwargs)
        name = op_name(func)
        if func.namespace in ("c10d", "_c10d_functional", "_dtensor") and name in _KINDS:
            self.records.append(self._trace(name, args, out))
        return out

    def _trace(self, name: str, args: tuple, out: Any) -> TracedCollective:
        kind = _KINDS[name]
        group_name, size = "", 1
        for a in args:
            if isinstance(a, str):
                group_name = a
            elif isinstance(a, torch.ScriptObject):
                pg = process_group_of(a)
                if pg is not None:
                    group_name, size = pg.group_name, pg.size()
        axis, size = self._axis(group_name, size)
        if name in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input, group, ...)
            full = _nbytes(args[0]) if kind == "all_gather" else _nbytes(args[1])
        elif kind == "all_gather":
            full = _nbytes(args[0]) * size
        else:
            full = _nbytes(args[0])
        return TracedCollective(name, kind, axis, size, full)

    def summary(self) -> dict[str, dict[str, float]]:
        """Bytes sent per axis and kind (same shape as :func:`lightning_4d.planner.comm.summarize`)."""
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for r in self.records:
            if r.bytes_sent:
                out[r.axis][r.kind] = out[r.axis].get(r.kind, 0.0) + r.bytes_sent
        return dict(out)

    def counts(self) -> dict[str, dict[str, int]]:
        """Number of calls per axis and kind."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for r in self.records:
            out[r.axis][r.kind] = out[r.axis].get(r.kind, 0) + 1
        return dict(out)


def fake_forward_backward(model: torch.nn.Module, inputs: torch.Tensor,
                          loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> Any:
    """Materialise a meta-device (already parallelised) ``model`` as fake tensors and run one forward
    and backward on ``inputs`` (``loss_fn(output)``, default ``output.float().sum()``). Returns the
    output (a fake tensor). Run it inside :func:`fake_world` and, to trace, a :class:`CollectiveRecorder`.

    Example:
        >>> fake_forward_backward(meta_model, torch.randint(0, 1024, (2, 256)))  # doctest: +SKIP
    """
    with fake_tensor_mode():
        model.to_empty(device="cpu")
        out = model(inputs)
        loss = loss_fn(out) if loss_fn is not None else out.float().sum()
        loss.backward()
    return out
