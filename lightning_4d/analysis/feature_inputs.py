"""What the trace learns about a block's own arguments and outputs beyond the hidden state (pure recording).

Two facts tensor parallelism needs and names cannot give:

- **feature inputs**: Gemma 3n / Gemma 4 hand every decoder layer a per-layer input ``(B, T, P)`` computed before
  the loop and multiply it, feature by feature, with ``act(per_layer_input_gate(h))`` before
  ``per_layer_projection``. When the gate is column-parallel each rank computes ``P / tp`` of those features, so the
  argument must be cut along its last dimension the same way on the way in. Found from the dataflow: the tensor
  arguments of a block's call are labelled (by position or keyword); the label follows layout ops (views, slices,
  casts); an argument is a feature input of linear ``L`` when a labelled tensor meets, in an elementwise op
  (``*``, ``+``, ``-``, ``/``), a tensor derived from ``L``'s output alone, along the same last dimension. The
  tensor-parallel plan keeps those whose width is ``L``'s output features
  (:func:`lightning_4d.tensor_parallel.block_inputs.feature_cuts`); rotary tables meet the queries per head and
  are not.
- **index modules**: a module inside a block whose output holds tensors but no floating-point one (DeepSeek-V3.2's
  sparse-attention ``indexer`` returns the top-k key positions, computed without gradients): nothing it computes
  is a feature another module reads, so tensor parallelism leaves its linears whole, computing on every rank.

Example:
    >>> import torch
    >>> rec = FeatureInputs()
    >>> arg, gate = torch.ones(2, 3, 4), torch.ones(2, 3, 4)
    >>> rec.label_call((torch.zeros(2, 3, 8), arg), {})
    >>> rec.follow("mul", (gate, arg), {}, gate * arg, lambda t: frozenset({"gate"}) if t is gate else frozenset())
    >>> rec.found
    {1: (4, frozenset({'gate'}))}
    >>> is_index_output((torch.zeros(2, dtype=torch.int32),)), is_index_output(torch.zeros(2))
    (True, False)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_4d.analysis.head_bias import ArgKey

__all__ = ["FeatureInputs", "is_index_output"]

# Ops through which an argument stays the same argument (its features where they were).
_LAYOUT = frozenset({"view", "reshape", "__getitem__", "narrow", "expand", "expand_as", "contiguous", "clone", "to",
                     "float", "half", "bfloat16", "double", "type_as", "unsqueeze", "squeeze", "detach"})
# Ops that combine their operands feature by feature.
_ELEMENTWISE = frozenset({"mul", "__mul__", "__rmul__", "mul_", "__imul__", "add", "__add__", "__radd__", "add_",
                          "__iadd__", "sub", "__sub__", "__rsub__", "sub_", "__isub__", "div", "__truediv__",
                          "__rtruediv__", "div_", "__itruediv__", "addcmul"})


def is_index_output(out: Any) -> bool:
    """Whether a module's output holds tensors, none of them floating-point (positions, indices, masks of bools).

    Example:
        >>> is_index_output(None), is_index_output((torch.zeros(1, dtype=torch.bool), torch.zeros(1)))
        (False, False)
    """
    tensors = _tensors(out)
    return bool(tensors) and not any(t.is_floating_point() or t.is_complex() for t in tensors)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class FeatureInputs:
    """Records, during one traced forward of a block, which of its arguments meet a linear's output feature by
    feature (see the module doc). ``found``: ``{argument: (its last dimension, {linears})}``.

    Example:
        >>> FeatureInputs().found
        {}
    """

    def __init__(self) -> None:
        self.found: dict[ArgKey, tuple[int, frozenset[str]]] = {}
        self._labels: dict[int, tuple[torch.Tensor, frozenset[ArgKey]]] = {}  # id -> (tensor kept alive, keys)

    def label_call(self, args: tuple, kwargs: dict) -> None:
        """Label the tensor arguments of a block's call (tuples followed) with their position or keyword."""
        for key, value in [*enumerate(args), *kwargs.items()]:
            for t in _tensors(value) if not isinstance(value, dict) else ():
                if t.dim() >= 2:
                    self._add(t, frozenset({key}))

    def _add(self, t: torch.Tensor, keys: frozenset[ArgKey]) -> None:
        entry = self._labels.get(id(t))
        old = entry[1] if entry is not None and entry[0] is t else frozenset()
        self._labels[id(t)] = (t, old | keys)

    def _of(self, t: Any) -> frozenset[ArgKey]:
        entry = self._labels.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else frozenset()

    def follow(self, name: str, args: tuple, kwargs: dict, out: Any,
               origin_of: Callable[[torch.Tensor], frozenset[str]]) -> None:
        """After op ``name``: carry labels through layout ops; record a labelled operand of an elementwise op whose
        other operand derives from one linear's output only (``origin_of(t)``: the linears ``t`` derives from)."""
        if not self._labels or not isinstance(out, torch.Tensor) or out.dim() < 2:
            return
        first = args[0] if args else None
        if name in _LAYOUT and self._of(first):
            self._add(out, self._of(first))
            return
        if name not in _ELEMENTWISE:
            return
        operands = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2]
        width = int(out.shape[-1])
        linears = [origin_of(t) for t in operands if not self._of(t) and int(t.shape[-1]) == width]
        linears = [o for o in linears if len(o) == 1]
        if not linears:
            return
        for t in operands:
            if int(t.shape[-1]) != width:
                continue
            for key in self._of(t):
                seen = self.found.get(key, (width, frozenset()))[1]
                self.found[key] = (width, seen.union(*linears))
