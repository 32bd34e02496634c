"""Private APIs behind the planner's dry runs: torch's ``fake`` process group, fake tensors, DTensor's
caches and the FSDP2 state of a wrapped module.

Example:
    >>> import torch
    >>> is_fake(torch.ones(1)), is_item_op(torch.ops.aten.mm.default)
    (False, False)
    >>> with fake_tensor_mode():
    ...     is_fake(torch.ones(1))
    True
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import nn
    from torch._ops import OperatorBase
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "clear_dtensor_caches",
    "fake_store",
    "fake_tensor_mode",
    "fsdp_param_group",
    "is_fake",
    "is_item_op",
    "unset_fake",
]


# ---------------------------------------------------------------------------------------------- fake world
def fake_store() -> dist.Store:
    """A ``Store`` for ``dist.init_process_group("fake", store=..., ...)`` (private
    ``torch.testing._internal.distributed.fake_pg.FakeStore``; importing it registers the ``fake`` backend).

    Raises:
        RuntimeError: where this torch has no such module.
    """
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:
        raise RuntimeError(
            f"the dry-run planner needs torch.testing._internal.distributed.fake_pg.FakeStore (the 'fake' "
            f"process group), which torch {torch.__version__} lacks; update lightning_4d/_compat/fake.py."
        ) from err
    return FakeStore()


# ---------------------------------------------------------------------------------------------- fake tensors
def fake_tensor_mode() -> FakeTensorMode:
    """A ``FakeTensorMode`` that accepts real inputs (private ``torch._subclasses.fake_tensor``,
    ``allow_non_fake_inputs=True``): tensors created inside it are fake (no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def unset_fake() -> AbstractContextManager[Optional[TorchDispatchMode]]:
    """A context in which tensors are real again inside a fake mode (private
    ``torch._subclasses.fake_tensor.unset_fake_temporarily``)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (private ``torch._subclasses.fake_tensor.FakeTensor``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def is_item_op(func: OperatorBase) -> bool:
    """Whether ``func`` (as seen by ``__torch_dispatch__``) is what ``Tensor.item()`` / ``.tolist()``
    dispatch to (the private operator ``aten._local_scalar_dense.default``)."""
    return func is torch.ops.aten._local_scalar_dense.default


# ---------------------------------------------------------------------------------------------- DTensor / FSDP2
def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding-propagation and redistribution caches.

    Their entries hold the ``DeviceMesh`` they were computed on (meshes hash by shape and names, not
    by process group), so after one fake world is destroyed and another built, stale entries would
    point at destroyed groups. Uses private ``torch.distributed.tensor.debug._clear_sharding_prop_cache``,
    ``torch.distributed.tensor._api.DTensor._op_dispatcher.sharding_propagator`` (its
    ``_propagate_tensor_meta_cached``) and ``torch.distributed.tensor._redistribute``
    (``_gen_transform_infos``, ``clear_redistribute_planner_cache``); caches a torch lacks are skipped.
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._api import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    meta_cache = getattr(type(propagator), "_propagate_tensor_meta_cached", None)
    if hasattr(meta_cache, "cache_clear"):
        meta_cache.cache_clear()
    for fn in ("_gen_transform_infos",):
        cached = getattr(_redistribute, fn, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    clear = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if callable(clear):
        clear()


def fsdp_param_group(module: nn.Module) -> Optional[Any]:
    """The ``FSDPParamGroup`` of an FSDP2-wrapped (``fully_shard``) module, or ``None`` when it is not
    wrapped or owns no parameters (private ``FSDPModule._get_fsdp_state()._fsdp_param_group``).

    Example:
        >>> fsdp_param_group(torch.nn.Linear(2, 2)) is None
        True
    """
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return None
    return getattr(get(), "_fsdp_param_group", None)
