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
  groups; :class:`CollectiveRecorder` (the package's recorder, :class:`lightning_4d.core.comm.CommCounter`,
  naming groups by mesh axis) adds bytes and the mesh axis of each call, in the format of
  :func:`lightning_4d.planner.comm.summarize`, so analytic and traced bytes can be compared (see
  ``tests/unit/test_planner_fake.py``: the TP bytes agree exactly).
- Limits: MoE layers do not run under plain fake tensors, even without EP: counting tokens per expert
  (``aten.bincount``) has a data-dependent output shape (``DynamicOutputShapeException``), and EP's
  all-to-all split sizes come from ``.tolist()`` on those counts. :mod:`lightning_4d.planner.dry_run`
  works around it with a uniform-routing stand-in (see there). Pipelining's point-to-point stages are
  not exercised (dry-run each stage's module per pp rank instead). The fake group gives no timing.

The private torch APIs this needs (``FakeStore``, which registers the ``fake`` backend;
``FakeTensorMode``; ``TorchDispatchMode``; ``ProcessGroup.unbox``, the group behind a ``c10d`` op's
script-object argument) are reached through :mod:`lightning_4d._compat`.

Example:
    >>> # not run: needs a process group (a fake one)
    >>> with fake_world(256, rank=3):  # doctest: +SKIP
    ...     mesh = init_device_mesh("cpu", (4, 8, 8), mesh_dim_names=("pp", "dp", "tp"))
    ...     with CollectiveRecorder(mesh) as rec:
    ...         fake_forward_backward(model, torch.randint(0, 1024, (2, 256)))
    ...     rec.summary()["tp"]
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist

from lightning_4d._compat import fake_store, fake_tensor_mode
from lightning_4d.core.comm import CommCounter, mesh_axis_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_4d.mesh import FourDMesh

__all__ = ["fake_world", "CollectiveRecorder", "fake_forward_backward"]


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


class CollectiveRecorder(CommCounter):
    """:class:`lightning_4d.core.comm.CommCounter` naming groups after the axes of ``mesh``.

    ``mesh`` (a ``DeviceMesh`` with dim names, a dict of them, or a ``FourDMesh``) names the groups through
    the package's one namer (:func:`lightning_4d.core.comm.axis_of_group`): a group several axes span is named by
    :func:`lightning_4d.core.comm.name_axis`; the default group is ``"world"``, others ``"other"``.

    Example:
        >>> with fake_world(4):
        ...     with CollectiveRecorder() as rec:
        ...         _ = dist.all_reduce(torch.ones(8))
        >>> rec.summary()
        {'world': {'all_reduce': 48.0}}
    """

    def __init__(self, mesh: Union[FourDMesh, DeviceMesh, Mapping[str, Union[FourDMesh, DeviceMesh]], None] = None
                 ) -> None:
        super().__init__(mesh_axis_groups(mesh))


def fake_forward_backward(model: torch.nn.Module, inputs: torch.Tensor,
                          loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> Any:
    """Materialise a meta-device (already parallelised) ``model`` as fake tensors and run one forward
    and backward on ``inputs`` (``loss_fn(output)``, default ``output.float().sum()``). Returns the
    output (a fake tensor). Run it inside :func:`fake_world` and, to trace, a :class:`CollectiveRecorder`.

    Example:
        >>> # not run: needs a process group (a fake one)
        >>> fake_forward_backward(meta_model, torch.randint(0, 1024, (2, 256)))  # doctest: +SKIP
    """
    with fake_tensor_mode():
        model.to_empty(device="cpu")
        out = model(inputs)
        loss = loss_fn(out) if loss_fn is not None else out.float().sum()
        loss.backward()
    return out
