"""Which tensors of a forward hold a data-dependent subset of the tokens, not positions of the sequence.

The context-parallel set-up check compares every module's output on a rank's chunk with the same rows of the whole
sequence's run. That is only meaningful for outputs laid out along the sequence. An expert of an MoE layer written
as a loop (``rows, slot = torch.where(chosen == e)``; ``expert(x[rows])``) receives the tokens routed to it: their
count and order depend on the routing, so its output is no sequence, even when it happens to have ``T`` rows.

:class:`TokenSubsets` follows such tensors through one forward: the results of the operations whose output size
depends on values (``nonzero``, one-argument ``where``, ``masked_select``, ``unique``, indexing with a boolean
mask) and everything computed from them, except an in-place write into a tensor that is not such a subset (the
layer's ``out.index_add_(0, rows, ...)`` or ``y[rows] += ...`` keeps ``out`` / ``y`` a sequence). A module that
receives or returns such a tensor is not compared (:meth:`TokenSubsets.touches`); the MoE layer around it is.

Example:
    >>> import torch
    >>> x = torch.arange(6.0).view(3, 2)
    >>> with TokenSubsets() as subsets:
    ...     rows, _ = torch.where(x > 2)
    ...     picked = x[rows] * 2
    ...     out = torch.zeros_like(x).index_add_(0, rows, picked)
    >>> subsets.touches((picked,), None), subsets.touches((x,), out)
    (True, False)
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["TokenSubsets"]

_DATA_DEPENDENT = {torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere, torch.masked_select,
                   Tensor.masked_select, torch.unique, Tensor.unique, torch.unique_consecutive,
                   Tensor.unique_consecutive}
# Writes into their first argument: the result is a subset only if that tensor was one.
_WRITES = {Tensor.__setitem__, Tensor.index_add, torch.index_add, Tensor.index_put, torch.index_put,
           Tensor.index_copy, torch.index_copy, Tensor.scatter, torch.scatter, Tensor.scatter_add, torch.scatter_add,
           Tensor.scatter_reduce, torch.scatter_reduce, Tensor.masked_scatter, torch.masked_scatter}


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return func in _WRITES or (name.endswith("_") and not name.endswith("__"))


class TokenSubsets(TorchFunctionMode):
    """While active, tags the tensors holding a data-dependent subset of the tokens (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # id -> weak reference (a WeakSet would compare tensors with ``==``, elementwise)
        self._tagged: dict[int, "weakref.ref[Tensor]"] = {}

    def _is(self, value: Any) -> bool:
        return any((ref := self._tagged.get(id(t))) is not None and ref() is t for t in _tensors(value))

    def touches(self, inputs: Any, output: Any) -> bool:
        """Whether a module called on ``inputs`` that returned ``output`` handled such a subset.

        Example:
            >>> TokenSubsets().touches((torch.ones(2),), torch.ones(2))
            False
        """
        return self._is(inputs) or self._is(output)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _DATA_DEPENDENT or (func is torch.where and len(args) == 1 and not kwargs):
            subset = True
        elif func is Tensor.__getitem__ and len(args) == 2:
            index = args[1]
            subset = self._is(args) or any(t.dtype == torch.bool for t in _tensors(index))
        elif _in_place(func):
            subset = bool(args) and self._is(args[0])
        else:
            subset = self._is(args) or self._is(kwargs)
        if subset:
            for tensor in _tensors(out):
                self._tagged[id(tensor)] = weakref.ref(tensor)
        return out
