"""The recorder a traced forward runs inside its blocks: the op consuming each linear's output, what derives from it.

:class:`_Consumers` is a :class:`~torch.overrides.TorchFunctionMode` that sees every torch function during the
recording of a block: the first op applied to each linear's output (a
:class:`~lightning_4d.analysis.trace_records.Consumer`), which linears each tensor derives from, the column layouts
(:mod:`lightning_4d.analysis.trace_columns`) and the attention-score biases (:mod:`lightning_4d.analysis.head_bias`).
:class:`_Facts` gathers what the module hooks of :func:`lightning_4d.analysis.trace.trace_model` record in one block and
turns it into that block's part of the :class:`~lightning_4d.analysis.trace_records.ModelTrace`.

Example:
    >>> import torch
    >>> mode = _Consumers()
    >>> out = torch.zeros(2, 3, 12)
    >>> mode.watch[id(out)] = ("qkv", out)
    >>> with mode:
    ...     q, k, v = out.split(4, dim=-1)
    >>> mode.seen["qkv"].pieces(12)
    [4, 4, 4]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from lightning_4d.analysis.feature_inputs import FeatureInputs
from lightning_4d.analysis.head_bias import ScoreBiases
from lightning_4d.analysis.trace_columns import _SCALE, _Columns
from lightning_4d.analysis.trace_records import Consumer, ModelTrace

__all__: list[str] = []  # internals of lightning_4d.analysis.trace, imported by name

_INSPECTIONS = ("__get__", "size", "dim", "numel", "__len__", "is_floating_point", "__format__", "__repr__")


class _Consumers(TorchFunctionMode):
    """Records the first torch function applied to each watched tensor, and which linears of the first block
    each tensor derives from (``origin``: every op's outputs inherit the union of its inputs' origins; a
    linear's output starts afresh with that linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.watch: dict[int, tuple[str, torch.Tensor]] = {}
        self.seen: dict[str, Consumer] = {}
        self.origin: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}  # id -> (tensor kept alive, linears)
        self.columns = _Columns()
        self.biases = ScoreBiases()
        self.features = FeatureInputs()  # the block's arguments that meet a linear's output feature by feature
        self.scaled: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor kept alive, id of what it scales)

    def root(self, t: torch.Tensor) -> int:
        """The id of the tensor ``t`` is a scalar multiple of (``x * multiplier``), or of ``t`` itself: a module that
        scales its input before a projection (Falcon-H1's ``ssm_in_multiplier``) still feeds it that input."""
        entry = self.scaled.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else id(t)

    def _concatenated(self, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """A concatenation along the features of pieces that all derive from one linear of the block only: followed
        (as channels at the last dimension) to a depthwise convolution, see :attr:`ColumnLayout.depthwise_parts`."""
        parts = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not isinstance(dim, int) or out.dim() < 2 or dim % out.dim() != out.dim() - 1 or len(parts) < 2:
            return
        if not all(isinstance(p, torch.Tensor) for p in parts):
            return
        origins = {self.origin_of(p) for p in parts}
        if len(origins) == len(parts) and all(len(o) == 1 for o in origins):
            self._joined(parts, out)
            return
        if len(origins) != 1:
            return
        (origin,) = origins
        if len(origin) != 1:
            return
        (rel,) = origin
        sizes = tuple(int(p.shape[-1]) for p in parts)
        self.columns.channels[id(out)] = (out, rel, 0, sum(sizes), out.dim() - 1)
        self.columns.catted[id(out)] = sizes

    def _joined(self, parts: Any, out: torch.Tensor) -> None:
        """A concatenation of whole tracked ranges of distinct linears (one each): followed as channels at the last
        dimension, see :attr:`ColumnLayout.depthwise_joined`."""
        members: list[tuple[str, int, int]] = []
        for p in parts:
            entry = self.columns.tracked.get(id(p))
            if entry is None or entry[0] is not p or entry[4] is not None or int(p.shape[-1]) != entry[3] - entry[2]:
                return
            members.append((entry[1], entry[2], entry[3]))
        if len({m[0] for m in members}) != len(members):
            return
        joined = tuple(members)
        self.columns.channels[id(out)] = (out, joined[0][0], 0, sum(b - a for _, a, b in joined), out.dim() - 1)
        self.columns.joined[id(out)] = (out, joined)

    def origin_of(self, value: Any) -> frozenset[str]:
        """The linears ``value`` (a tensor, or a nest of them) derives from."""
        found: set[str] = set()
        for t in _tensors(value):
            entry = self.origin.get(id(t))
            if entry is not None and entry[0] is t:
                found |= entry[1]
        return frozenset(found)

    def tag(self, value: Any, origin: frozenset[str]) -> None:
        for t in _tensors(value):
            self.origin[id(t)] = (t, origin)

    def __torch_function__(self, func: Callable[..., Any], types: tuple[type, ...], args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self.watch and args and name not in _INSPECTIONS:
            first = args[0]
            if isinstance(first, torch.Tensor) and id(first) in self.watch:
                rel, _ = self.watch.pop(id(first))
                rest = tuple(a for a in args[1:] if not isinstance(a, torch.Tensor))
                self.seen.setdefault(rel, Consumer(name, rest, dict(kwargs), first.dim()))
        out = func(*args, **kwargs)
        if name in _SCALE and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor) and all(
                isinstance(x, (int, float)) for x in args[1:]) and out.shape == args[0].shape:
            self.scaled[id(out)] = (out, self.root(args[0]))
        if name == "cat" and args and isinstance(args[0], (list, tuple)) and isinstance(out, torch.Tensor):
            self._concatenated(args, kwargs, out)
        if self.columns.tracked and name not in _INSPECTIONS:
            self.columns.follow(name, args, kwargs, out)
        if self.origin and name not in _INSPECTIONS:
            origin = self.origin_of((args, kwargs))
            if origin:
                self.tag(out, origin | self.origin_of(out))  # in-place ops keep what the target had
        if name not in _INSPECTIONS:
            self.biases.follow(name, args, kwargs, out, lambda t: bool(self.origin_of(t)))
            self.features.follow(name, args, kwargs, out, self.origin_of)
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


@dataclass
class _Facts:
    """What the hooks record inside one representative block (relative paths)."""

    inputs: dict[str, int] = field(default_factory=dict)
    parent_inputs: dict[str, int] = field(default_factory=dict)
    last_linear: dict[str, str] = field(default_factory=dict)
    sources: dict[str, frozenset[str]] = field(default_factory=dict)
    module_sources: dict[str, frozenset[str]] = field(default_factory=dict)
    input_ndim: dict[str, int] = field(default_factory=dict)
    index_modules: set[str] = field(default_factory=set)
    int_reads: dict[str, dict[str, int]] = field(default_factory=dict)
    mode: Optional[_Consumers] = None

    def into(self, trace: ModelTrace) -> ModelTrace:
        """``trace`` with this block's facts."""
        assert self.mode is not None
        takes = set()
        for rel, tid in self.inputs.items():
            parent = rel.rpartition(".")[0]
            if parent and self.parent_inputs.get(parent) == tid:
                takes.add(rel)
        return replace(trace, consumers=dict(self.mode.seen), columns=dict(self.mode.columns.layouts),
                       score_biases=dict(self.mode.biases.found), last_linear=self.last_linear,
                       sources=self.sources, module_sources=self.module_sources, input_ndim=self.input_ndim,
                       int_reads=self.int_reads, takes_block_input=takes, kinds={},
                       feature_inputs=dict(self.mode.features.found), index_modules=frozenset(self.index_modules))
