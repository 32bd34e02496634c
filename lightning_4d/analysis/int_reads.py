"""Which integers a module's own forward reads, from itself and from its ``config``, and uses as a count of groups
in a tensor's shape: found by watching the forward, whatever the attributes are called.

Tensor parallelism must give a region (an attention, a mixer) per-rank head counts: LitGPT's attention reads
``self.config.n_head`` and ``self.config.n_query_groups`` and views its projections as
``q.view(B, T, n_head, head_size)``; transformers' use ``self.config.num_attention_heads``, others their own names.
A list of names always misses one, so the trace records every ``int`` attribute each watched module's forward reads
while it is the innermost module running — from its own instance (``"n_head"``) or from the object in its
``config`` attribute (``"config.n_query_groups"``) — and *passes as it is* to ``view`` / ``reshape`` /
``unflatten`` / ``expand`` as a dimension other than the last: a number of groups (heads), not a width (the last
dimension, a slice bound, a split size) nor a ratio (``repeat_interleave``'s repeats). The tensor-parallel planner
(:func:`lightning_4d.tensor_parallel.plan.block_plan`) gives such an integer its per-rank value when it is one of
the region's head counts as the traced projections show them.

Reads are seen by giving each watched object a subclass of its class for the forward (as FSDP2 does) whose
``__getattribute__`` hands out the integer as an ``int`` subclass remembering where it was read (arithmetic on it
gives plain ``int``\\s: only direct uses are attributed); the classes are restored on exit. Objects whose class
cannot be swapped (slots, C types) are not watched. Reads from elsewhere (a parent, a global, an argument) are not
seen: the set-up value check still catches a size computed from them.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Cfg:
    ...     def __init__(self):
    ...         self.n_groups, self.rotary = 2, 2
    >>> class Attn(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.config, self.width = Cfg(), 8
    ...     def forward(self, x):
    ...         x = x.view(*x.shape[:-1], self.config.n_groups, self.width // self.config.n_groups)
    ...         return x[..., : self.config.rotary]
    >>> attn = Attn()
    >>> with watch_int_reads({"attn": attn}) as counts:
    ...     _ = attn(torch.zeros(1, 8))
    >>> counts["attn"], type(attn).__name__
    ({'config.n_groups': 2}, 'Attn')
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["CONFIG_PREFIX", "watch_int_reads"]

#: How a read from the module's ``config`` object is keyed: ``"config.<attribute>"``.
CONFIG_PREFIX = "config."

_STATE = threading.local()  # the watched modules running on this thread, innermost last: (module, path)
_SUBCLASSES: dict[type, type] = {}
# Shape functions whose non-last dimensions count groups: (function, index of the first shape argument).
_SHAPES = {Tensor.view: 1, Tensor.reshape: 1, torch.reshape: 1, Tensor.expand: 1, Tensor.unflatten: 2,
           torch.unflatten: 2}


class _ReadInt(int):
    """An integer read from a watched module (``path``) or its config (``key``)."""

    path: str
    key: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read(owner: Any, name: str, value: Any) -> Any:
    """``value``, as a :class:`_ReadInt` when it is an int attribute of the innermost watched module or its config."""
    stack = getattr(_STATE, "stack", None)
    if not stack or not _is_int(value) or isinstance(value, _ReadInt):
        return value
    module, path = stack[-1]
    if owner is module:
        key = name
    elif owner is vars(module).get("config"):
        key = CONFIG_PREFIX + name
    else:
        return value
    # instance attributes only (not class constants), or one a config maps to another name (transformers'
    # ``attribute_map``: Falcon's ``num_attention_heads`` is its ``num_heads``)
    if name not in vars(owner) and name not in (getattr(type(owner), "attribute_map", None) or {}):
        return value
    read = _ReadInt(value)
    read.path, read.key = path, key
    return read


def _watching(cls: type) -> type:
    """A subclass of ``cls`` whose int attribute reads are marked (one per class)."""
    if cls not in _SUBCLASSES:
        def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807 - the hook itself
            value = cls.__getattribute__(self, name)
            return value if name.startswith("__") else _read(self, name, value)

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                                       "__qualname__": cls.__qualname__,
                                                       "__module__": cls.__module__})
    return _SUBCLASSES[cls]


def _swap(obj: Any, swapped: list[tuple[Any, type]]) -> None:
    cls = type(obj)
    if cls in _SUBCLASSES.values() or any(o is obj for o, _ in swapped):
        return
    try:
        obj.__class__ = _watching(cls)
    except TypeError:  # slots, a C type or a class refusing a subclass: not watched
        return
    swapped.append((obj, cls))


def _plain_object(value: Any) -> bool:
    """A config-like object: has instance attributes, is no module, tensor or builtin container."""
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, Tensor, type))
            and not callable(value) and type(value).__module__ != "builtins")


class _Counts(TorchFunctionMode):
    """Records the marked integers passed to a shape function as a dimension other than the last."""

    def __init__(self, counts: dict[str, dict[str, int]]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        first = _SHAPES.get(func)
        if first is not None and len(args) > first:
            dims = args[first] if len(args) == first + 1 and isinstance(args[first], (tuple, list)) \
                else args[first:]
            for dim in list(dims)[:-1]:
                if isinstance(dim, _ReadInt):
                    self.counts.setdefault(dim.path, {}).setdefault(dim.key, int(dim))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watch_int_reads(modules: Mapping[str, nn.Module]) -> Iterator[dict[str, dict[str, int]]]:
    """While active, record ``{path: {attribute: value}}``: the ``int`` attributes each of ``modules`` (``{path:
    module}``) reads in its own forward, from itself or its ``config``, and passes to a shape function as a count
    of groups (see the module docstring).

    Example:
        >>> with watch_int_reads({}) as counts:
        ...     pass
        >>> counts
        {}
    """
    counts: dict[str, dict[str, int]] = {}
    swapped: list[tuple[Any, type]] = []
    handles = []

    def enter(module: nn.Module, path: str) -> None:
        _STATE.stack = [*getattr(_STATE, "stack", []), (module, path)]

    def leave() -> None:
        _STATE.stack = getattr(_STATE, "stack", [])[:-1]

    try:
        for path, module in modules.items():
            config = vars(module).get("config")
            if config is not None and _plain_object(config):
                _swap(config, swapped)
            _swap(module, swapped)
            handles.append(module.register_forward_pre_hook(lambda m, _a, p=path: enter(m, p)))
            handles.append(module.register_forward_hook(lambda *_: leave(), always_call=True))
        with _Counts(counts):
            yield counts
    finally:
        for handle in handles:
            handle.remove()
        for obj, cls in reversed(swapped):
            obj.__class__ = cls
