"""Private ``torch.distributed`` APIs: groups and ``Work`` behind ``c10d`` ops, ``DeviceMesh`` options,
FSDP-based ``replicate``, DTensor shard offsets.

Example:
    >>> process_group_of("not a group") is None
    True
"""

from __future__ import annotations

import contextlib
import functools
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

__all__ = [
    "mesh_groups",
    "mesh_backend_override",
    "patch_work_wait",
    "process_group_of",
    "flatten_mesh",
    "replicate",
    "shard_global_offset",
    "unbox_work",
    "unflatten_mesh",
]


# ---------------------------------------------------------------------------------------------- mesh and wrappers
def mesh_backend_override(backend: str, timeout: Optional[timedelta], ndim: int) -> Optional[tuple]:
    """Per-dimension ``(backend, options)`` for ``DeviceMesh`` so sub-groups inherit our timeout (``backend``: a
    name or a ``"device:backend"`` string of one backend, e.g. ``"cuda:gloo"``).

    ``DeviceMesh`` sub-groups otherwise get torch's 30-minute default instead of the world's
    timeout, and a failing rank would leave the others hanging. Uses the private
    ``ProcessGroupGloo._Options`` / ``ProcessGroupNCCL.Options`` ``_timeout`` field (``None``, torch's
    default, where it is missing).
    """
    if timeout is None:
        return None
    # A "device:backend" string ("cuda:gloo", "cpu:gloo,cuda:nccl") takes the options of its one backend.
    kinds = {pair.rpartition(":")[2].strip().lower() for pair in backend.split(",")}
    try:
        if kinds == {"gloo"}:
            opts: Any = dist.ProcessGroupGloo._Options()
        elif kinds == {"nccl"}:
            opts = dist.ProcessGroupNCCL.Options()
        else:
            return None
        opts._timeout = timeout
    except (AttributeError, RuntimeError):
        return None
    return tuple((backend, opts) for _ in range(ndim))


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str,
                 backend_override: Optional[tuple] = None) -> DeviceMesh:
    """Make ``mesh[name]`` the union of ``dims`` (one process group over them), keeping ``mesh[dims]``:
    the private ``DeviceMesh._flatten`` (torch has no public flatten yet).

    Example:
        >>> # not run: needs a process group
        >>> flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp")  # doctest: +SKIP
    """
    kwargs = {"backend_override": backend_override} if backend_override is not None else {}
    return mesh[dims]._flatten(name, **kwargs)


def unflatten_mesh(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...],
                   backend_override: Optional[tuple] = None) -> Optional[DeviceMesh]:
    """``mesh`` with dimension ``dim`` split into ``names`` of ``sizes`` (row-major), new process groups for those
    alone: the private ``DeviceMesh._unflatten`` (``None`` where this torch lacks it). ``backend_override``: one
    ``(backend, options)`` per new dimension, as :func:`mesh_backend_override` gives.

    Example:
        >>> # not run: needs a process group
        >>> unflatten_mesh(root, "dp_cp_tp", (2, 2), ("edp", "ep"))  # doctest: +SKIP
    """
    if not hasattr(mesh, "_unflatten"):
        return None
    kwargs = {"backend_override": dict(zip(names, backend_override))} if backend_override is not None else {}
    return mesh._unflatten(dim, sizes, names, **kwargs)


def replicate(module: nn.Module, mesh: DeviceMesh, mp_policy: Optional[MixedPrecisionPolicy] = None,
              ignored_params: Optional[set[nn.Parameter]] = None) -> nn.Module:
    """Data-parallel replication built on FSDP2 machinery (private
    ``torch.distributed._composable.replicate_with_fsdp.replicate``).

    It keeps full parameters on every rank and all-reduces gradients, and composes with
    DTensor tensor-parallel parameters like ``fully_shard`` does.
    """
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate as _replicate
    except ImportError as err:
        raise ImportError(
            f"data_parallel='replicate' needs torch.distributed._composable.replicate_with_fsdp, which torch "
            f"{torch.__version__} lacks; use data_parallel='fsdp'."
        ) from err

    kwargs: dict[str, Any] = {"mesh": mesh, "ignored_params": ignored_params}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    return _replicate(module, **kwargs)


def shard_global_offset(tensor: DTensor) -> tuple[int, ...]:
    """Global offset of this rank's shard of a DTensor, for any placement combination (private
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``).

    Raises:
        NotImplementedError: naming the symbol, where this torch lacks it.
    """
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as err:
        raise NotImplementedError(
            f"torch {torch.__version__} has no torch.distributed.tensor._utils.compute_local_shape_and_global_offset "
            f"(needed for the global offset of a DTensor shard); update lightning_4d/_compat/distributed.py."
        ) from err
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(int(o) for o in offset)


# ---------------------------------------------------------------------------------------------- c10d objects
def process_group_of(arg: Any) -> Optional[dist.ProcessGroup]:
    """The ``ProcessGroup`` behind a collective op's group argument, or ``None`` (not a group).

    Functional collectives pass the group *name* (private ``distributed_c10d._resolve_process_group``);
    ``c10d`` ops a script object (undocumented ``ProcessGroup.unbox``).
    """
    if isinstance(arg, str):
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(arg)
        except Exception:  # noqa: BLE001 - not a group name (e.g. the reduce op "sum"), or no such helper
            return None
    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg)
        except Exception:  # noqa: BLE001 - another script object (ReduceOp, Work, ...)
            return None
    return None


def mesh_groups(meshes: list[DeviceMesh]) -> Optional[list[dist.ProcessGroup]]:
    """The live process groups behind every dimension of ``meshes``, or ``None`` once one is destroyed. A mesh
    keeps its groups' *names* and resolves them through the private ``c10d`` registry (``_world.pg_map``), so a
    caller keeping meshes compares these objects: after ``destroy_process_group`` a name can resolve to another
    world's group.
    """
    from torch.distributed import distributed_c10d as c10d

    try:
        groups = [mesh.get_group(dim) for mesh in meshes for dim in range(mesh.ndim)]
    except Exception:  # noqa: BLE001 - a destroyed group no longer resolves by name
        return None
    live = c10d._world.pg_map
    return groups if all(g in live for g in groups) else None


def unbox_work(obj: torch.ScriptObject) -> Optional[dist.Work]:
    """The Python ``Work`` for a ``c10d`` op's script-object result (the object the ``torch.distributed``
    call returns; undocumented ``Work.unbox``), or ``None``."""
    try:
        return dist.Work.unbox(obj)
    except Exception:  # noqa: BLE001 - not a Work, or no such helper
        return None


_WAIT_LISTENERS: list[Callable[[dist.Work, float, float], None]] = []
_WAIT_STATE: dict[str, Callable[..., bool]] = {}


@contextlib.contextmanager
def patch_work_wait(listener: Callable[[dist.Work, float, float], None]) -> Iterator[None]:
    """Wrap ``torch.distributed.Work.wait`` while the block runs, reporting ``(work, t0, t1)`` of every
    wait to ``listener``; restored on exit (nested uses share one wrapper, the last exit restores it).

    A monkey-patch of a pybind class: ``Work`` accepts a Python function as its ``wait`` attribute;
    every ``work.wait()`` issued from Python (``torch.distributed``'s synchronous calls, FSDP2, the
    pipeline schedules) goes through it.
    """
    if not _WAIT_LISTENERS:
        original = dist.Work.wait

        @functools.wraps(original)
        def timed_wait(self: dist.Work, *args: Any, **kwargs: Any) -> bool:
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                t1 = time.perf_counter()
                for fn in list(_WAIT_LISTENERS):
                    fn(self, t0, t1)

        _WAIT_STATE["original"] = original
        dist.Work.wait = timed_wait  # type: ignore[method-assign]
    _WAIT_LISTENERS.append(listener)
    try:
        yield
    finally:
        _WAIT_LISTENERS.remove(listener)
        if not _WAIT_LISTENERS:
            dist.Work.wait = _WAIT_STATE.pop("original")  # type: ignore[method-assign]
