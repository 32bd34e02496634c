"""What one traced forward records: the values :func:`~lightning_4d.analysis.trace.trace_model` returns, no behaviour.

:class:`ModelTrace` is the whole record (execution order, the blocks, the modules around them, the facts of each
kind of block); :class:`HiddenArg` says where a block takes and returns the hidden state; :class:`Consumer` is the
first op applied to a linear's output and :class:`ColumnLayout` how the model cuts and groups its output features.
They hold values only: taking a trace is :mod:`lightning_4d.analysis.trace`'s job.

Example:
    >>> ModelTrace(blocks_path="layers", hidden=HiddenArg(position=0, tuple_out=2)).hidden.wrap("h")
    ('h', None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

from lightning_4d._compat import registered_submodule
from lightning_4d.analysis.head_bias import ArgKey

__all__ = ["ColumnLayout", "Consumer", "HiddenArg", "ModelTrace", "SPLIT_OPS"]

# Ops that cut a fused projection's output into pieces along its last dimension.
SPLIT_OPS = ("split", "split_with_sizes", "chunk", "tensor_split", "unbind")


@dataclass(frozen=True)
class HiddenArg:
    """Where a block receives the hidden state and how it returns it.

    ``position`` (positional index) or ``keyword`` names the argument; ``tuple_out`` is ``None`` when the
    block returns the hidden state itself, else the length of the tuple it returns (hidden state first).

    Example:
        >>> HiddenArg(position=0).get((1, 2), {})
        1
    """

    position: Optional[int] = 0
    keyword: Optional[str] = None
    tuple_out: Optional[int] = None

    def get(self, args: tuple, kwargs: dict) -> Any:
        """The hidden state among a call's arguments."""
        if self.keyword is not None and self.keyword in kwargs:
            return kwargs[self.keyword]
        return args[self.position or 0]

    def replace(self, args: tuple, kwargs: dict, value: Any) -> tuple[tuple, dict]:
        """The call's arguments with the hidden state replaced by ``value``."""
        if self.keyword is not None and self.keyword in kwargs:
            return args, {**kwargs, self.keyword: value}
        pos = self.position or 0
        return args[:pos] + (value,) + args[pos + 1:], kwargs

    def carrier(self, output: Any) -> Any:
        """The hidden state inside a block's output."""
        return output[0] if self.tuple_out is not None else output

    def wrap(self, hidden: Any) -> Any:
        """A block output carrying ``hidden`` (for blocks skipped on this stage)."""
        return hidden if self.tuple_out is None else (hidden,) + (None,) * (self.tuple_out - 1)


@dataclass
class ModelTrace:
    """What one forward did (paths relative to the traced root).

    Attributes:
        order: module paths in the order they were first entered.
        blocks_path: the container of repeated blocks.
        block_order: block keys in the order they were called (each once).
        hidden: where blocks take and return the hidden state.
        pre / post: outermost modules outside the blocks (and not containing them) entered only before
            the first block / only after the last one.
        elsewhere: such modules entered between blocks or both before and after them.
        consumers: for each linear module inside the first block (path relative to the block), the first
            op applied to its output (:class:`Consumer`).
        takes_block_input: linears (relative to their block) whose input is their parent module's input.
        last_linear: per parent module inside the first block, the last linear it called.
        sources: for each linear inside the first block, the linears of that block whose outputs reach its
            input (through any ops, not through another linear).
        module_sources: the same for every other module inside the first block (norms, per-head modules).
        input_ndim: for every module inside the first block, the number of dimensions of its main input.
        columns: for each linear inside the first block, how the model cuts and reshapes its output features
            (:class:`ColumnLayout`: ``split`` / slices along the features, per-head ``view`` widths).
        score_biases: for modules inside the first block, the tensor arguments added to attention scores along the
            heads (ALiBi; :mod:`lightning_4d.analysis.head_bias`): ``{module: {argument: (shape, batch)}}``.
        output: the model's output.
        kinds: for each block whose structure (module paths and classes) differs from the first block's, the
            same facts recorded in the first block of its structure (see :meth:`for_block`).
    """

    order: list[str] = field(default_factory=list)
    blocks_path: str = ""
    block_order: tuple[str, ...] = ()
    hidden: HiddenArg = field(default_factory=HiddenArg)
    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()
    elsewhere: tuple[str, ...] = ()
    consumers: dict[str, "Consumer"] = field(default_factory=dict)
    takes_block_input: set[str] = field(default_factory=set)
    last_linear: dict[str, str] = field(default_factory=dict)
    sources: dict[str, frozenset[str]] = field(default_factory=dict)
    module_sources: dict[str, frozenset[str]] = field(default_factory=dict)
    input_ndim: dict[str, int] = field(default_factory=dict)
    columns: dict[str, "ColumnLayout"] = field(default_factory=dict)
    score_biases: dict[str, dict[ArgKey, tuple[tuple[int, ...], int]]] = field(default_factory=dict)
    # module path in the block -> {attribute: value}: the ints its own forward read from itself or its ``config``
    # and used as a count of groups in a shape (``"config.n_query_groups"``; :mod:`lightning_4d.analysis.int_reads`)
    int_reads: dict[str, dict[str, int]] = field(default_factory=dict)
    output: Any = None
    kinds: dict[str, "ModelTrace"] = field(default_factory=dict)  # block key -> the facts of its kind's first block
    # block key -> its plain attributes (Nemotron-H's ``block_type``, read by the model's loop to pick a mask)
    block_attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the first block's arguments that meet a linear's output feature by feature: {argument: (width, {linears})}
    # (Gemma 4's per-layer input; :mod:`lightning_4d.analysis.feature_inputs`)
    feature_inputs: dict[ArgKey, tuple[int, frozenset[str]]] = field(default_factory=dict)
    index_modules: frozenset[str] = frozenset()  # modules of the first block whose outputs hold no float tensor
    # block arguments that are one container several blocks may write and read (Gemma 4's ``shared_kv_states``)
    shared_args: tuple[str, ...] = ()

    def for_block(self, key: str) -> "ModelTrace":
        """The trace whose per-block facts (sources, columns, ...) are those of block ``key``'s kind: a hybrid's
        Mamba layers are described by its first Mamba layer, its attention layers by its first attention layer.

        Example:
            >>> ModelTrace().for_block("3").blocks_path
            ''
        """
        return self.kinds.get(key, self)

    @property
    def _index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.order)}

    def first_of(self, root: nn.Module, paths: tuple[str, ...], kind: tuple[type, ...], last: bool = False) -> Optional[str]:
        """The first (or last) module of ``kind`` entered at or below ``paths``, by execution order."""
        index = self._index
        found = []
        for base in paths:
            mod = registered_submodule(root, base)
            if mod is None:
                continue
            for sub_name, sub in mod.named_modules():
                path = f"{base}.{sub_name}" if sub_name else base
                if isinstance(sub, kind) and path in index:
                    found.append((index[path], path))
        if not found:
            return None
        return (max(found) if last else min(found))[1]


@dataclass(frozen=True)
class Consumer:
    """The first op applied to a linear's output: its name, non-tensor arguments and the output's rank.

    Example:
        >>> Consumer("split", (32,), {"dim": 2}, 3).pieces(96)
        [32, 32, 32]
    """

    op: str
    args: tuple
    kwargs: dict
    ndim: int

    def pieces(self, width: int) -> Optional[list[int]]:
        """Sizes of the pieces cut along the last dimension (``None`` if this op does not cut it)."""
        if self.op not in SPLIT_OPS or self.op == "unbind":
            return None
        dim = self.args[1] if len(self.args) > 1 else self.kwargs.get("dim", 0)
        if not isinstance(dim, int) or dim % self.ndim != self.ndim - 1:
            return None
        arg = self.args[0] if self.args else next(iter(v for k, v in self.kwargs.items() if k != "dim"), None)
        if self.op == "chunk" and isinstance(arg, int):
            return [width // arg] * arg if width % arg == 0 else None
        if self.op in ("split", "split_with_sizes"):
            if isinstance(arg, int):
                return [arg] * (width // arg) if width % arg == 0 else None
            if isinstance(arg, (list, tuple)) and sum(arg) == width:
                return [int(a) for a in arg]
        if self.op == "tensor_split" and isinstance(arg, int):
            return [width // arg] * arg if width % arg == 0 else None
        return None


@dataclass
class ColumnLayout:
    """How a model uses the output features of one linear, recorded during the traced forward.

    ``cuts``: feature ranges ``(start, stop)`` the model takes apart (``split`` / ``chunk`` / ``qkv[..., a:b]`` along
    the features, or a slice of the heads after a per-head ``view``); ``units``: for a range, the width of the
    groups a ``view`` / ``reshape`` makes of it (``view(B, T, -1, head_dim)``: ``head_dim``; an interleaved
    ``view(B, T, n_kv, r, head_dim)``: ``r·head_dim``). Sharding a range over ``tp`` ranks must keep those groups
    whole. ``depthwise``: ranges that went through a depthwise convolution along the sequence (``groups`` equal to
    the channels: a state-space or short-convolution mixer's ``conv1d`` on ``x.transpose(1, 2)``), each channel on
    its own, so the convolution's channels follow the features over the ranks. ``scales``: buffers of the block
    (paths in it) the model multiplies a range by, feature by feature (a ``(1, 1, W)`` scale vector).
    ``feature_params``: parameters of the block (paths in it) added to or multiplying a range feature by feature
    (Kimi-Linear's ``f_b_proj(x) + dt_bias.view(1, 1, -1)``).
    ``depthwise_parts``: a depthwise convolution over a concatenation of pieces cut inside this linear's per-head
    groups (Qwen3-Next: ``q | k | v`` of every key-head group), by the pieces' sizes. ``depthwise_joined``: a
    depthwise convolution over a concatenation of the outputs of several linears (Kimi-Linear's
    ``cat(q_proj(x), k_proj(x), v_proj(x))``), as its members ``(linear, start, stop)`` in order (recorded in each
    member's layout).

    Example:
        >>> c = ColumnLayout(48, {(0, 32), (32, 40), (40, 48)}, {(0, 32): 8, (32, 40): 8, (40, 48): 8})
        >>> c.pieces()
        [(0, 32, 8), (32, 40, 8), (40, 48, 8)]
    """

    width: int
    cuts: set[tuple[int, int]] = field(default_factory=set)
    units: dict[tuple[int, int], int] = field(default_factory=dict)
    groups: dict[tuple[int, int], bool] = field(default_factory=dict)  # range -> viewed as interleaved groups
    depthwise: set[tuple[int, int]] = field(default_factory=set)  # ranges convolved channel by channel
    scales: dict[str, tuple[int, int]] = field(default_factory=dict)  # block buffer multiplying a range, per feature
    feature_params: dict[str, tuple[int, int]] = field(default_factory=dict)  # block parameter on a range, per feature
    # concatenations of pieces cut inside this linear's groups, convolved channel by channel: the pieces' sizes
    depthwise_parts: set[tuple[int, ...]] = field(default_factory=set)
    # concatenations of several linears' ranges convolved channel by channel: (linear, start, stop) per member
    depthwise_joined: set[tuple[tuple[str, int, int], ...]] = field(default_factory=set)

    def pieces(self) -> list[tuple[int, int, Optional[int]]]:
        """Consecutive feature ranges ``(start, stop, unit)`` between every cut point, each with the width of the
        groups a ``view`` makes of the smallest recorded range containing it (``None``: never viewed in groups)."""
        points = sorted({0, self.width} | {p for c in self.cuts for p in c})
        out: list[tuple[int, int, Optional[int]]] = []
        for a, b in zip(points, points[1:]):
            holding = sorted((hi - lo, u) for (lo, hi), u in self.units.items() if lo <= a and b <= hi)
            unit = next((u for _, u in holding if (b - a) % u == 0), None)
            out.append((a, b, unit))
        return out
