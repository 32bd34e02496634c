"""Block arguments cut with the features of the column-parallel linear they meet, and linears left whole.

Gemma 3n / Gemma 4 multiply each layer's per-layer input ``(B, T, P)`` (computed before the blocks) feature by
feature with ``act(per_layer_input_gate(h))`` and project the product back with ``per_layer_projection``: the
Megatron pattern (column → local math → row) around an argument. The gate is column-parallel (a linear whose output
meets a block argument of its full width: :func:`feature_gates`), the projection row-parallel (the last linear the
block calls), and the argument is cut to this rank's ``P / tp`` features on the way into the block
(:func:`feature_cuts`, :func:`install_feature_cuts`: a ``Replicate → Shard(-1)`` redistribution whose backward
all-gathers the gradient, so what made the argument gets the whole gradient on every rank). Found from the trace
(:mod:`lightning_4d.analysis.feature_inputs`), not from names; the set-up value check compares the result.

Linears inside an *index module* (a module whose output holds no floating-point tensor: DeepSeek-V3.2's
``indexer``, top-k key positions computed without gradients) are left whole (:func:`whole_linears`): each rank
computes the same positions from the region's gathered input.

Example:
    >>> from lightning_4d.analysis.trace import ModelTrace
    >>> trace = ModelTrace(feature_inputs={1: (8, frozenset({"gate"})), 0: (32, frozenset({"o_proj"}))})
    >>> block = nn.Module(); block.gate = nn.Linear(32, 8)
    >>> feature_gates(block, trace)
    {'gate'}
    >>> whole_linears(["self_attn.indexer.wq_b", "self_attn.q_proj"], frozenset({"self_attn.indexer"}))
    {'self_attn.indexer.wq_b'}
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_4d.analysis.head_bias import ArgKey
from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.analysis.trace import ModelTrace
from lightning_4d.tensor_parallel.styles import linear_features

__all__ = ["feature_cuts", "feature_gates", "install_feature_cuts", "whole_linears"]


def _inputs(trace: Optional[ModelTrace]) -> dict[ArgKey, tuple[int, frozenset[str]]]:
    """The traced feature inputs other than the hidden state (which meets every output projection)."""
    if trace is None:
        return {}
    hidden = {trace.hidden.keyword} if trace.hidden.keyword is not None else {trace.hidden.position or 0}
    return {k: v for k, v in trace.feature_inputs.items() if k not in hidden}


def _width(block: nn.Module, name: str, trace: Optional[ModelTrace] = None) -> Optional[int]:
    """The output features of linear ``name``; ``None`` for one the model views per head (its features meet a
    rotary table head by head, not as a whole)."""
    layout = trace.columns.get(name) if trace is not None else None
    if layout is not None and layout.units:
        return None
    try:
        return linear_features(block.get_submodule(name))[1]
    except (AttributeError, TypeError, ValueError):
        return None


def feature_gates(block: nn.Module, trace: Optional[ModelTrace]) -> set[str]:
    """Linears of ``block`` whose whole output meets a block argument feature by feature (Gemma 4's
    ``per_layer_input_gate``): column-parallel, the argument cut with them.

    Example:
        >>> feature_gates(nn.Linear(2, 2), None)
        set()
    """
    return {name for width, linears in _inputs(trace).values() for name in linears
            if _width(block, name, trace) == width}


def whole_linears(linears: Iterable[str], index_modules: frozenset[str]) -> set[str]:
    """The linears inside an index module (see the module doc): kept whole, computed on every rank.

    Example:
        >>> whole_linears(["a.b"], frozenset({"a"})), whole_linears(["a.b"], frozenset())
        ({'a.b'}, set())
    """
    return {n for n in linears if any(n.startswith(m + ".") for m in index_modules)}


def feature_cuts(block_name: str, block: nn.Module, linears: Mapping[str, str], permuted: Iterable[str],
                 trace: Optional[ModelTrace], tp: int) -> dict[ArgKey, int]:
    """``{argument: width}``: the block arguments to cut along their last dimension (``width`` features, ``tp``
    even pieces), those that meet only column-parallel linears (``linears``: name -> role) of their full width;
    raises naming the argument when it meets one whose output features are permuted or not column-parallel.

    Example:
        >>> from lightning_4d.analysis.trace import ModelTrace
        >>> block = nn.Module(); block.gate = nn.Linear(32, 8)
        >>> trace = ModelTrace(feature_inputs={1: (8, frozenset({"gate"}))})
        >>> feature_cuts("layers.0", block, {"gate": "colwise"}, (), trace, 2)
        {1: 8}
    """
    cuts: dict[ArgKey, int] = {}
    moved = set(permuted)
    for key, (width, met) in _inputs(trace).items():
        full = sorted(n for n in met if _width(block, n, trace) == width)
        if not full:
            continue  # a rotary table meets the queries per head, not a linear's whole output
        bad = [n for n in full if linears.get(n) != "colwise" or n in moved]
        if bad:
            raise ValueError(
                f"{block_name}: its argument {key!r} ({width} features) is combined feature by feature with the "
                f"output of {block_name}.{bad[0]}, which tensor parallelism does not split into {tp} plain pieces "
                f"({linears.get(bad[0], 'no role')}{', rows permuted' if bad[0] in moved else ''}), so the argument "
                f"cannot be cut to match. Implement {hook_call(TP_PLAN)} for this model, or use tp=1.")
        if width % tp:
            raise ValueError(f"{block_name}: its argument {key!r} has {width} features, not divisible by tp={tp} "
                             f"(it is cut with {block_name}.{full[0]}'s output); use a tp dividing {width}.")
        cuts[key] = width
    return cuts


def install_feature_cuts(block: nn.Module, cuts: Mapping[ArgKey, int], tp_mesh: Any) -> None:
    """During ``block``'s forward each argument in ``cuts`` (``{argument: width}``) is cut to this rank's piece of
    its last dimension, as the column-parallel linear it meets computes its features; its gradient is gathered
    back to the whole on every rank.

    Example:
        >>> # not run: needs a process group
        >>> install_feature_cuts(model.layers[0], {1: 256}, mesh["tp"])  # doctest: +SKIP
    """
    where = type(block).__name__

    def cut(key: ArgKey, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        if int(x.shape[-1]) != cuts[key]:
            raise ValueError(f"{where} argument {key!r}: {int(x.shape[-1])} features, but {cuts[key]} when the "
                             f"model was traced and planned; use tp=1 or implement {hook_call(TP_PLAN)}.")
        full = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)  # (..., P)
        return full.redistribute(placements=[Shard(x.dim() - 1)]).to_local()  # (..., P/tp)

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple(cut(i, a) if i in cuts else a for i, a in enumerate(args))
        return args, {k: cut(k, v) if k in cuts else v for k, v in kwargs.items()}

    block.register_forward_pre_hook(hook, with_kwargs=True)
