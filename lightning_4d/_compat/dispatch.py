"""Private dispatcher / autograd APIs: ``TorchDispatchMode``, operator objects, the autograd engine, pytrees.

Example:
    >>> import torch
    >>> op_name(torch.ops.aten.mm.default), in_backward()
    ('mm', False)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Optional

import torch
from torch.utils import _pytree as pytree  # private ``torch.utils._pytree`` (no public pytree module yet)

if TYPE_CHECKING:
    from torch._ops import OperatorBase
    from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["view_base", "disabled_torch_function", "dispatch_mode_base", "in_backward", "is_higher_order_op", "meta_scalar_mode", "op_is_view",
           "op_name", "op_schema", "pytree", "trunc_normal_hook", "wrapper_subclass"]


def dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode`` (what ``CommDebugMode`` builds on), to subclass.

    Where it is missing, a stand-in base whose ``__enter__`` raises, so modules defining a mode
    still import.
    """
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:

        class TorchDispatchMode:  # type: ignore[no-redef]
            def __enter__(self) -> NoReturn:
                raise RuntimeError(
                    f"torch {torch.__version__} has no torch.utils._python_dispatch.TorchDispatchMode; "
                    f"update lightning_4d/_compat/dispatch.py."
                )

            def __exit__(self, *exc: object) -> None:
                return None

    return TorchDispatchMode


def is_higher_order_op(func: OperatorBase) -> bool:
    """Whether ``func`` (as seen by ``__torch_dispatch__``) is a ``torch._ops.HigherOrderOperator``,
    which a dispatch mode should run rather than inspect."""
    cls = getattr(getattr(torch, "_ops", None), "HigherOrderOperator", None)
    return cls is not None and isinstance(func, cls)


def op_name(func: OperatorBase) -> str:
    """The overload packet's name of an ``OpOverload`` (``aten.mm.default`` → ``"mm"``); ``OpOverload``
    lives in the private ``torch._ops``."""
    packet = getattr(func, "overloadpacket", None) or getattr(func, "_overloadpacket", None)
    return packet.__name__ if packet is not None else str(func)


def op_schema(func: OperatorBase) -> Any:
    """The ``torch._C.FunctionSchema`` of an ``OpOverload`` (its private ``_schema``: ``arguments``,
    ``is_mutable``, ...).

    Example:
        >>> import torch
        >>> op_schema(torch.ops.aten.add_.Tensor).is_mutable, op_schema(torch.ops.aten.mm.default).arguments[0].name
        (True, 'self')
    """
    return func._schema


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (private
    ``torch._C._current_graph_task_id() != -1``; ``False`` where it is missing)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def meta_scalar_mode(value: float = 0) -> TorchDispatchMode:
    """A ``TorchDispatchMode`` under which reading a scalar out of a meta tensor (``.item()``, ``bool(t)``: the
    private ``aten._local_scalar_dense``) returns ``value`` (``False`` for booleans) instead of raising. For
    tracing a model's structure on the meta device when its forward has data-dependent shortcuts (e.g.
    transformers' mask helpers asking whether a sequence is packed); never for computing values.

    Example:
        >>> with meta_scalar_mode():
        ...     bool(torch.ones(1, device="meta").all())
        False
    """
    base = dispatch_mode_base()

    class _MetaScalars(base):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func: OperatorBase, types: tuple[type, ...], args: tuple[Any, ...] = (),
                               kwargs: Optional[dict[str, Any]] = None) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default and args and args[0].is_meta:
                t = args[0]
                if t.dtype == torch.bool:
                    return bool(value)
                return float(value) if t.is_floating_point() else int(value)
            return func(*args, **(kwargs or {}))

    return _MetaScalars()


def wrapper_subclass(cls: type, like: torch.Tensor, device: torch.device, requires_grad: bool = False) -> Any:
    """An instance of the tensor subclass ``cls`` with ``like``'s shape, strides, offset and dtype on ``device`` and
    no memory of its own (the private ``Tensor._make_wrapper_subclass``)."""
    return torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(),
                                               storage_offset=like.storage_offset(), dtype=like.dtype,
                                               device=device, requires_grad=requires_grad)


#: ``__torch_function__`` for a subclass that handles everything in ``__torch_dispatch__`` (private
#: ``torch._C._disabled_torch_function_impl``).
disabled_torch_function = torch._C._disabled_torch_function_impl


def op_is_view(func: OperatorBase) -> bool:
    """Whether the ATen op returns a view of its first argument (``OpOverload.is_view``)."""
    return bool(getattr(func, "is_view", False))


@contextmanager
def trunc_normal_hook(hook: Callable[..., Any]) -> Iterator[None]:
    """Inside: ``torch.nn.init.trunc_normal_`` (and every caller of its private helper
    ``torch.nn.init._no_grad_trunc_normal_``, e.g. transformers' guarded copy) calls
    ``hook(tensor, mean, std, a, b, generator, original)`` instead; ``original`` is torch's helper."""
    import torch.nn.init as init

    original = init._no_grad_trunc_normal_

    def patched(tensor: torch.Tensor, mean: float, std: float, a: float, b: float, generator: Any = None) -> Any:
        return hook(tensor, mean, std, a, b, generator, original)

    init._no_grad_trunc_normal_ = patched
    try:
        yield
    finally:
        init._no_grad_trunc_normal_ = original


def view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``t`` is a view of (``Tensor._base``), or ``None`` for a tensor that owns its storage (on the meta
    device too, where storages cannot be compared).

    Example:
        >>> x = torch.zeros(2, 3)
        >>> view_base(x[:, 1:]) is x, view_base(x) is None
        (True, True)
    """
    return t._base
