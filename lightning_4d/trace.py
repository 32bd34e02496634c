"""How a model actually runs: one forward on a tiny input, recorded (one process, no communication).

Tensor and pipeline parallelism need facts that a model's *registration* order does not give: which
module is the token embedding and which the output head (Hugging Face keeps ``lm_head`` beside
``model``, not after ``model.layers``), what else each block receives (rotary tables, masks,
position ids: ``layer(h, position_embeddings=..., attention_mask=...)``), which argument carries the
hidden state from block to block, and how a fused projection's output is cut (``split`` of a
concatenated ``q|k|v`` or a per-head ``view``). :func:`trace_model` runs the model once in eval mode
without gradients and records them in a :class:`ModelTrace`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = nn.Embedding(10, 4)
    ...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    ...         self.head = nn.Linear(4, 10)
    ...     def forward(self, x):
    ...         h = self.emb(x)
    ...         for layer in self.layers:
    ...             h = layer(h)
    ...         return self.head(h)
    >>> t = trace_model(Net(), "layers", torch.zeros(1, 3, dtype=torch.long))
    >>> t.pre, t.post, t.block_order, t.hidden.position
    (('emb',), ('head',), ('0', '1'), 0)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_4d._compat import child_modules, registered_submodule
from lightning_4d.head_bias import ArgKey, ScoreBiases
from lightning_4d.hooks import PIPELINE_HOOKS, PIPELINE_POST, PIPELINE_PRE, PIPELINE_SPLIT, hook_call
from lightning_4d.layer_kinds import holds_routed_experts, is_linear, is_norm

__all__ = ["ColumnLayout", "Consumer", "HiddenArg", "ModelTrace", "trace_model", "example_tokens", "first_param_name",
           "SPLIT_OPS"]

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
            heads (ALiBi; :mod:`lightning_4d.head_bias`): ``{module: {argument: (shape, batch)}}``.
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
    output: Any = None
    kinds: dict[str, "ModelTrace"] = field(default_factory=dict)  # block key -> the facts of its kind's first block
    # block key -> its plain attributes (Nemotron-H's ``block_type``, read by the model's loop to pick a mask)
    block_attrs: dict[str, dict[str, Any]] = field(default_factory=dict)

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


def example_tokens(module: nn.Module, tp: int = 1, seq: Optional[int] = None) -> torch.Tensor:
    """Tiny token ids valid for every ``nn.Embedding`` of ``module`` (``example_input_array`` wins, unless ``seq``
    asks for another length): the package's one example input (the trace, the reduced check and the pipeline's
    sequential check use it; the context-parallel check with its own ``seq``).

    Example:
        >>> example_tokens(nn.Sequential(nn.Embedding(5, 2))).shape
        torch.Size([2, 8])
        >>> example_tokens(nn.Sequential(nn.Embedding(5, 2)), seq=12).shape
        torch.Size([2, 12])
    """
    sample = getattr(module, "example_input_array", None)
    if sample is not None and (seq is None or tuple(getattr(sample, "shape", ()))[1:2] == (seq,)):
        return sample
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        raise ValueError(
            f"Cannot build an example input for {type(module).__name__} (it has no nn.Embedding). Set "
            f"`self.example_input_array` on the module to a small batch of inputs."
        )
    high = min(m.num_embeddings for m in tables)
    seq = seq or max(8, 2 * tp)
    device = tables[0].weight.device if tables[0].weight.device.type != "meta" else torch.device("cpu")
    return torch.randint(0, high, (2, seq), generator=torch.Generator().manual_seed(0)).to(device)


def first_param_name(module: nn.Module) -> Optional[str]:
    """Name of the first parameter of ``module.forward`` (its main input when passed by keyword)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return named[0].name if named else None


_INSPECTIONS = ("__get__", "size", "dim", "numel", "__len__", "is_floating_point", "__format__", "__repr__")


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


# Elementwise on one tensor: every feature stays where it is (DBRX clamps its fused qkv, then splits it).
_ELEMENTWISE = ("clamp", "clamp_", "clip", "clip_", "tanh", "sigmoid", "relu", "gelu", "silu", "neg", "__neg__", "abs")
_KEEP_LAST = ("unsqueeze", "squeeze", "contiguous", "clone", "to", "float", "half", "bfloat16", "double", "type_as",
              "detach", "view", "reshape", "view_as", "reshape_as", "flatten", "expand", "__getitem__",
              "narrow") + _ELEMENTWISE
_ADD = ("add", "__add__", "__radd__", "__iadd__", "add_")
_SCALE = ("mul", "__mul__", "__rmul__", "div", "__truediv__")
_MOVE = ("transpose", "swapaxes", "swapdims", "permute", "movedim")


def _dim_entry(key: Any, ndim: int, dim: int) -> Any:
    """The index applied to dimension ``dim`` of an ``ndim``-d tensor by ``tensor[key]``; ``slice(None)`` when the
    key leaves it alone; ``...`` (Ellipsis) when that cannot be told (advanced indexing elsewhere, new axes)."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is None for k in key):
        return ...
    consuming = [k for k in key if k is not Ellipsis]
    if sum(k is Ellipsis for k in key) > 1 or len(consuming) > ndim:
        return ...
    if Ellipsis in key:
        at = key.index(Ellipsis)
        full = list(key[:at]) + [slice(None)] * (ndim - len(consuming)) + list(key[at + 1:])
    else:
        full = list(key) + [slice(None)] * (ndim - len(key))
    return full[dim]


def _as_range(entry: Any, size: int) -> Optional[tuple[int, int]]:
    """A contiguous range of ``range(size)`` selected by a slice or a list of consecutive ints (``None`` otherwise)."""
    if isinstance(entry, slice):
        a, b, step = entry.indices(size)
        return (a, b) if step == 1 and b > a else None
    if isinstance(entry, (list, tuple)) and entry and all(isinstance(i, int) and not isinstance(i, bool) for i in entry):
        idx = [i % size for i in entry]
        return (idx[0], idx[-1] + 1) if idx == list(range(idx[0], idx[-1] + 1)) else None
    return None


def _moved_dim(name: str, args: tuple, ndim: int, dim: int) -> Optional[int]:
    """Where dimension ``dim`` of an ``ndim``-d tensor goes under ``permute`` / ``transpose``-like ``name`` with
    ``args`` (``None``: cannot be told).

    Example:
        >>> _moved_dim("transpose", (None, 1, 2), 3, 2), _moved_dim("permute", (None, (0, 2, 1)), 3, 1)
        (1, 2)
    """
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        order = [d % ndim for d in dims if isinstance(d, int)]
        return order.index(dim) if len(order) == ndim and dim in order else None
    moved = [d % ndim for d in args[1:3] if isinstance(d, int)]
    return (moved[1] if moved[0] == dim else moved[0] if moved[1] == dim else dim) if len(moved) == 2 else None


class _Columns:
    """Follows each first-block linear's output through the ops that keep its features addressable (layout ops,
    cuts, per-head views) and records a :class:`ColumnLayout` per linear."""

    def __init__(self) -> None:
        self.layouts: dict[str, ColumnLayout] = {}
        # id -> (tensor kept alive, linear, start, stop, group width: None = the last dim is the features,
        # d = the last two dims are (groups, d) over the features)
        self.tracked: dict[int, tuple[torch.Tensor, str, int, int, Optional[int]]] = {}
        self.names: dict[int, str] = {}  # id of a buffer of the block -> its path in the block
        # id -> (tensor kept alive, path in the block): a parameter of the block, or a view / cast of one
        self.params: dict[int, tuple[torch.Tensor, str]] = {}
        # id of a channels entry -> the sizes of the pieces of one linear it concatenates (Qwen3-Next's
        # ``cat((q, k, v))`` of pieces cut inside per-key-head groups; its range is ``(0, sum(sizes))``)
        self.catted: dict[int, tuple[int, ...]] = {}
        # id -> (tensor kept alive, linear, start, stop, dim): the features moved to dimension ``dim`` (channels
        # first, ``(B, C, T)``, for a convolution along the sequence)
        self.channels: dict[int, tuple[torch.Tensor, str, int, int, int]] = {}
        # id -> (tensor kept alive, members): a concatenation of ranges of several linears (``(linear, start,
        # stop)`` each, in order), as channels (in ``channels``) or back at the last dimension
        self.joined: dict[int, tuple[torch.Tensor, tuple[tuple[str, int, int], ...]]] = {}

    def watch(self, rel: str, out: torch.Tensor) -> None:
        width = int(out.shape[-1]) if out.dim() else 0
        self.layouts.setdefault(rel, ColumnLayout(width))
        self.tracked[id(out)] = (out, rel, 0, width, None)

    def same(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst`` holds ``src``'s features in place (the output of a norm applied to ``src``)."""
        entry = self.tracked.get(id(src))
        if entry is not None and entry[0] is src and entry[4] is None:
            self._track(dst, entry[1], entry[2], entry[3], None)

    def _track(self, t: Any, rel: str, a: int, b: int, sub: Optional[int]) -> None:
        if isinstance(t, torch.Tensor):
            self.tracked[id(t)] = (t, rel, a, b, sub)

    def _follow_channels(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """A tracked range whose features sit at dimension ``dim`` (``(B, C, T)``): through a depthwise ``conv1d``
        (recorded in :attr:`ColumnLayout.depthwise`), slices along the other dimensions, elementwise ops, and back
        to the last dimension by a transpose."""
        first = args[0]
        t, rel, a, b, dim = self.channels[id(first)]
        ndim = first.dim()
        joined = self.joined.get(id(first))
        if joined is not None and joined[0] is first and t is first:
            self._follow_joined(name, args, kwargs, out, joined[1], dim)
            return
        parts = self.catted.get(id(first))
        if parts is not None:
            if t is first and isinstance(out, torch.Tensor) and out.dim() == ndim:
                self.catted[id(out)] = parts  # kept below only where the channels stay
            if name == "conv1d" and t is first and dim == 1:
                groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
                if groups == b - a and isinstance(out, torch.Tensor) and int(out.shape[1]) == b - a:
                    self.layouts[rel].depthwise_parts.add(parts)
                    self.channels[id(out)] = (out, rel, a, b, 1)
                return
        if t is first and name in SPLIT_OPS and name != "unbind" and isinstance(out, (tuple, list)) and parts is None:
            at = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if isinstance(at, int) and at % ndim == dim:  # LFM2's ``B, C, x = BCx.chunk(3, dim=-2)``
                cur = a
                for piece in out:
                    size = int(piece.shape[dim])
                    self.layouts[rel].cuts.add((cur, cur + size))
                    self.channels[id(piece)] = (piece, rel, cur, cur + size, dim)
                    cur += size
            return
        if t is not first or not isinstance(out, torch.Tensor) or out.dim() != first.dim():
            return
        if name == "conv1d":
            groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
            if dim == 1 and ndim == 3 and groups == b - a and int(out.shape[1]) == b - a:
                self.layouts[rel].depthwise.add((a, b))
                self.channels[id(out)] = (out, rel, a, b, 1)
        elif name in _MOVE:
            new = _moved_dim(name, args, ndim, dim)
            if new == ndim - 1:
                if parts is None:
                    self._track(out, rel, a, b, None)
            elif new is not None:
                self.channels[id(out)] = (out, rel, a, b, new)
        elif name == "__getitem__" and len(args) > 1:
            if _dim_entry(args[1], ndim, dim) == slice(None) and int(out.shape[dim]) == b - a:
                self.channels[id(out)] = (out, rel, a, b, dim)
        elif name in _ELEMENTWISE + ("contiguous", "clone", "to", "float", "type_as", "silu", "mul", "__mul__",
                                     "__rmul__") and tuple(out.shape) == tuple(first.shape):
            self.channels[id(out)] = (out, rel, a, b, dim)

    def _follow_joined(self, name: str, args: tuple, kwargs: dict, out: Any, members: tuple[tuple[str, int, int], ...],
                       dim: int) -> None:
        """A concatenation of several linears' ranges (channels at ``dim``, see :attr:`ColumnLayout.depthwise_joined`)
        through a depthwise ``conv1d`` (recorded in every member's layout), moves, slices along other dimensions and
        elementwise ops; back at the last dimension, a split at the members' boundaries returns each its own range."""
        first = args[0]
        ndim, total = first.dim(), sum(b - a for _, a, b in members)
        if dim == ndim - 1 and name in SPLIT_OPS:
            self._split_joined(name, args, kwargs, out, members)
            return
        if not isinstance(out, torch.Tensor) or out.dim() != ndim:
            return
        new: Optional[int] = dim
        if name == "conv1d":
            groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
            if dim != 1 or groups != total or int(out.shape[1]) != total:
                return
            for rel, _, _ in members:
                self.layouts[rel].depthwise_joined.add(members)
        elif name in _MOVE:
            new = _moved_dim(name, args, ndim, dim)
        elif name == "__getitem__" and len(args) > 1:
            if _dim_entry(args[1], ndim, dim) != slice(None) or int(out.shape[dim]) != total:
                return
        elif name not in _ELEMENTWISE + ("contiguous", "clone", "to", "float", "type_as") \
                or tuple(out.shape) != tuple(first.shape):
            return
        if new is None:
            return
        self.joined[id(out)] = (out, members)
        self.channels[id(out)] = (out, members[0][0], 0, total, new)

    def _split_joined(self, name: str, args: tuple, kwargs: dict, out: Any,
                      members: tuple[tuple[str, int, int], ...]) -> None:
        """A split along the last dimension of a joined concatenation at its members' boundaries: each piece is its
        member's range again (Kimi-Linear's ``q, k, v = split(conv_out, [d] * 3, dim=-1)``)."""
        first = args[0]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if name not in SPLIT_OPS or name == "unbind" or not isinstance(out, (tuple, list)) or not isinstance(dim, int) \
                or dim % first.dim() != first.dim() - 1:
            return
        if [int(p.shape[-1]) for p in out] == [b - a for _, a, b in members]:
            for piece, (rel, a, b) in zip(out, members):
                self._track(piece, rel, a, b, None)

    def _param_of(self, t: Any) -> Optional[str]:
        """The block parameter ``t`` is (or a view / cast of), by its path in the block."""
        entry = self.params.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is t else None

    def _feature_param(self, name: str, args: tuple, out: Any, rel: str, a: int, b: int) -> None:
        """``range + param`` / ``range * param`` with a block parameter shaped ``(W,)`` or ``(1, ..., 1, W)`` over
        the range's ``W`` features: recorded in :attr:`ColumnLayout.feature_params`, the sum still the range."""
        first, other = args[0], args[1]
        path = self._param_of(other)
        width = int(first.shape[-1])
        if path is None or not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(first.shape) \
                or int(other.shape[-1]) != width or any(int(d) != 1 for d in other.shape[:-1]):
            return
        self.layouts[rel].feature_params[path] = (a, b)
        self._track(out, rel, a, b, None)

    def _summed(self, rel: str, a: int, b: int, other: Any, out: torch.Tensor) -> bool:
        """``out = x + y``, ``x`` and ``y`` the whole outputs of two linears (a low-rank adapter added to the
        projection it adapts: Zamba2's ``q_proj(h) + adapter(h)``): their features are added one by one, so both
        share one layout from here on (what the model does with the sum is recorded for both)."""
        entry = self.tracked.get(id(other)) if isinstance(other, torch.Tensor) else None
        first = self.layouts[rel]
        if (entry is None or entry[0] is not other or entry[4] is not None or entry[1] == rel
                or tuple(other.shape) != tuple(out.shape) or (a, b) != (0, first.width)):
            return False
        _, rel2, a2, b2, _ = entry
        second = self.layouts[rel2]
        if (a2, b2) != (0, second.width) or second.width != first.width or second != ColumnLayout(second.width):
            return False
        self.layouts[rel2] = first
        self._track(out, rel, a, b, None)
        return True

    def follow(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        first = args[0] if args else None
        if self.params and isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor) \
                and name in ("view", "reshape", "float", "to", "type_as", "unsqueeze") and out.numel() == first.numel():
            path = self._param_of(first)
            if path is not None:
                self.params[id(out)] = (out, path)
        if isinstance(first, torch.Tensor) and id(first) in self.channels:
            self._follow_channels(name, args, kwargs, out)
            return
        entry = self.tracked.get(id(first)) if isinstance(first, torch.Tensor) else None
        if entry is None or entry[0] is not first or first.dim() == 0:
            return
        _, rel, a, b, sub = entry
        layout = self.layouts[rel]
        ndim, last = first.dim(), int(first.shape[-1])
        if name in SPLIT_OPS:
            at = 1 if name == "unbind" else 2  # split(t, sizes, dim), chunk(t, n, dim), unbind(t, dim)
            dim = args[at] if len(args) > at else kwargs.get("dim", 0)
            if not isinstance(dim, int) or not isinstance(out, (tuple, list)):
                return
            dim %= ndim
            if sub is None and dim == ndim - 1 and name != "unbind":
                cur = a
                for piece in out:
                    size = int(piece.shape[-1])
                    layout.cuts.add((cur, cur + size))
                    self._track(piece, rel, cur, cur + size, None)
                    cur += size
            elif sub is not None and dim == ndim - 2 and name != "unbind":
                cur = a
                for piece in out:
                    size = int(piece.shape[-2]) * sub
                    layout.cuts.add((cur, cur + size))
                    layout.units.setdefault((cur, cur + size), sub)
                    self._track(piece, rel, cur, cur + size, sub)
                    cur += size
            elif sub is None and dim < ndim - 1:
                for piece in out:
                    self._track(piece, rel, a, b, None)
            return
        if not isinstance(out, torch.Tensor) or out.dim() == 0:
            return
        if name in _ADD and sub is None and len(args) == 2 and self._summed(rel, a, b, args[1], out):
            return
        if name in _SCALE and sub is None and tuple(out.shape) == tuple(first.shape) and all(
                isinstance(x, (int, float)) for x in args[1:]):
            self._track(out, rel, a, b, None)  # q * scaling
            return
        if name in ("add", "__add__", "mul", "__mul__") and sub is None and len(args) == 2 \
                and self._param_of(args[1]) is not None:
            self._feature_param(name, args, out, rel, a, b)
            return
        if name in ("mul", "__mul__") and sub is None and tuple(out.shape) == tuple(first.shape) and len(args) == 2:
            other = args[1]
            path = self.names.get(id(other)) if isinstance(other, torch.Tensor) else None
            if path is not None and int(other.shape[-1]) == last and all(int(d) == 1 for d in other.shape[:-1]):
                # a per-feature scale the block holds (Falcon-H1's ``in_proj(x) * self.mup_vector``, (1, 1, W))
                layout.scales[path] = (a, b)
                self._track(out, rel, a, b, None)
            return
        if name in _MOVE:
            if name == "permute":
                dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
                order = [d % ndim for d in dims if isinstance(d, int)]
                keep = len(order) == ndim and order[-1] == ndim - 1 and (sub is None or order[-2] == ndim - 2)
            else:  # transpose(d0, d1), movedim(source, destination)
                moved = [d for d in args[1:3] if isinstance(d, int)]
                keep = len(moved) == 2 and not {d % ndim for d in moved} & ({ndim - 1} if sub is None
                                                                            else {ndim - 1, ndim - 2})
                if sub is None and name != "movedim" and len(moved) == 2 and ndim - 1 in {d % ndim for d in moved}:
                    # the features moved to another dimension (channels first, for a convolution)
                    distinct = moved[0] % ndim != moved[1] % ndim
                    other = next(d % ndim for d in moved if d % ndim != ndim - 1) if distinct else None
                    if other is not None and isinstance(out, torch.Tensor):
                        self.channels[id(out)] = (out, rel, a, b, other)
            if keep:
                self._track(out, rel, a, b, sub)
            return
        if name not in _KEEP_LAST:
            return
        if name == "__getitem__" and len(args) > 1:
            if sub is None:
                span = _as_range(_dim_entry(args[1], ndim, ndim - 1), last)
                if span is not None and span != (0, last) and int(out.shape[-1]) == span[1] - span[0]:
                    lo, hi = a + span[0], a + span[1]
                    layout.cuts.add((lo, hi))
                    self._track(out, rel, lo, hi, None)
                elif int(out.shape[-1]) == last and _dim_entry(args[1], ndim, ndim - 1) == slice(None):
                    self._track(out, rel, a, b, None)
            else:
                span = _as_range(_dim_entry(args[1], ndim, ndim - 2), int(first.shape[-2]))
                if span is not None and _dim_entry(args[1], ndim, ndim - 1) == slice(None):
                    lo, hi = a + span[0] * sub, a + span[1] * sub
                    layout.cuts.add((lo, hi))
                    layout.units.setdefault((lo, hi), sub)
                    self._track(out, rel, lo, hi, sub)
            return
        if name == "narrow" and sub is None:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            start = args[2] if len(args) > 2 else kwargs.get("start")
            length = args[3] if len(args) > 3 else kwargs.get("length")
            if isinstance(dim, int) and dim % ndim == ndim - 1 and isinstance(start, int) and isinstance(length, int):
                lo = a + start % last
                layout.cuts.add((lo, lo + length))
                self._track(out, rel, lo, lo + length, None)
            elif isinstance(dim, int) and dim % ndim != ndim - 1:
                self._track(out, rel, a, b, None)
            return
        width = b - a
        grouped = name in ("view", "reshape") and out.dim() > first.dim()
        if sub is None and int(out.shape[-1]) == last and not grouped:
            self._track(out, rel, a, b, None)
            return
        if sub is None and name in ("view", "reshape", "flatten") and out.numel() == first.numel():
            # the features cut into groups: (..., n, d) or interleaved (..., n, r, d)
            shape, k, prod = list(out.shape), out.dim(), 1
            while k > 0 and prod < width:
                k -= 1
                prod *= int(shape[k])
            if prod == width and k == out.dim() - 1 and k > first.dim() - 1 and shape[k - 1] == 1:
                k -= 1  # (..., 1, width): one group
            if prod != width or k == out.dim() - 1:
                return
            factors = shape[k:]
            unit = width // int(factors[0])
            layout.units.setdefault((a, b), unit)
            layout.groups.setdefault((a, b), len(factors) > 2)
            if len(factors) == 2:
                self._track(out, rel, a, b, int(factors[1]))
            return
        if sub is not None and name in ("view", "reshape", "unflatten") and out.dim() > first.dim() \
                and int(out.shape[-1]) == sub and out.numel() == first.numel():
            # per-head groups regrouped: (..., H, d) -> (..., n, r, d) (Falcon's new decoder views its per-head
            # view again by KV group): groups of r·d, coarser than one head, keep both whole
            r = int(out.shape[-2])
            if r > 1 and int(first.shape[-2]) % r == 0:
                layout.units[(a, b)] = max(layout.units.get((a, b), sub), r * sub)
                layout.groups[(a, b)] = True
            return
        if sub is not None and name in ("view", "reshape", "flatten", "contiguous", "clone", "to", "float",
                                        "type_as") + _ELEMENTWISE and tuple(out.shape[-2:]) == tuple(first.shape[-2:]):
            self._track(out, rel, a, b, sub)

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
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _structure(block: nn.Module) -> tuple[tuple[str, str], ...]:
    """What makes two blocks the same kind: their module paths and classes (a Mamba layer and an attention layer of
    one hybrid list differ; the layers of a plain decoder do not)."""
    return tuple((n, type(m).__qualname__) for n, m in block.named_modules())


@dataclass
class _Facts:
    """What the hooks record inside one representative block (relative paths)."""

    inputs: dict[str, int] = field(default_factory=dict)
    parent_inputs: dict[str, int] = field(default_factory=dict)
    last_linear: dict[str, str] = field(default_factory=dict)
    sources: dict[str, frozenset[str]] = field(default_factory=dict)
    module_sources: dict[str, frozenset[str]] = field(default_factory=dict)
    input_ndim: dict[str, int] = field(default_factory=dict)
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
                       takes_block_input=takes, kinds={})


def trace_model(root: nn.Module, blocks_path: str, example: Any) -> ModelTrace:
    """Run ``root(example)`` once (eval, no grad) and record what :class:`ModelTrace` describes. The per-block facts
    are those of the first block; a block of another structure (a hybrid's Mamba layer after an attention layer) has
    those of the first block like it, in :meth:`ModelTrace.for_block`.

    Raises:
        ValueError: when the blocks are not each called once, in order, on the previous block's output.
    """
    trace = ModelTrace(blocks_path=blocks_path)
    container = registered_submodule(root, blocks_path)
    if container is None:
        raise ValueError(f"{type(root).__name__} has no module at {blocks_path!r}")
    blocks = child_modules(container)
    block_ids = {id(m): k for k, m in blocks.items()}
    names: dict[int, str] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), name)
    first_of_kind: dict[tuple, str] = {}
    rep_of = {key: first_of_kind.setdefault(_structure(block), key) for key, block in blocks.items()}
    # every block records its facts; a kind's are its first block's, completed by the later blocks of the kind
    # (modules a block skips by depth: Zamba2's shared block runs one adapter of its list per use)
    facts = {key: _Facts() for key in blocks}
    # module id -> (path inside its block, block key); a module shared by several blocks is recorded in the first
    in_rep: dict[int, tuple[str, str]] = {}
    for key in facts:
        for n, m in blocks[key].named_modules():
            if n:
                in_rep.setdefault(id(m), (n, key))
    block_calls: list[tuple[str, tuple, dict, Any]] = []
    events: list[tuple[str, str]] = []  # ("block", key) or ("module", path) in entry order
    recording: list[str] = []  # the representative block running now (its first call)
    module_inputs: dict[int, torch.Tensor] = {}
    mode = _Consumers()

    def current(mod: nn.Module) -> Optional[tuple[str, _Facts]]:
        found = in_rep.get(id(mod))
        if found is None or not recording or found[1] != recording[-1]:
            return None
        return found[0], facts[found[1]]

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        nonlocal mode
        path = names.get(id(mod))
        if path is None:
            return
        if path not in trace.order:
            trace.order.append(path)
        events.append(("module", path))
        key = block_ids.get(id(mod))
        if key in facts and facts[key].mode is None:
            # a fresh recorder per kind: what this block's linears produce, from nothing earlier blocks left
            mode.__exit__(None, None, None)
            mode = _Consumers()
            mode.columns.names = {id(b): n for n, b in blocks[key].named_buffers()}
            mode.columns.params = {id(p): (p, n) for n, p in blocks[key].named_parameters()}
            mode.__enter__()
            facts[key].mode = mode
            recording.append(key)
        here = current(mod)
        if here is None:
            return
        rel, f = here
        main = args[0] if args else (kwargs.get(first_param_name(mod) or "") if kwargs else None)
        if isinstance(main, torch.Tensor):
            f.parent_inputs.setdefault(rel, mode.root(main))
            f.input_ndim.setdefault(rel, main.dim())
            if is_linear(mod):
                f.inputs.setdefault(rel, mode.root(main))
                f.sources.setdefault(rel, mode.origin_of(main))
            else:
                f.module_sources.setdefault(rel, mode.origin_of(main))
                module_inputs[id(mod)] = main
            mode.biases.label_call(rel, args, kwargs, main)

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        main = module_inputs.pop(id(mod), None)
        if main is not None and isinstance(out, torch.Tensor) and out.shape == main.shape and is_norm(mod):
            mode.columns.same(main, out)  # a norm keeps the features where they are
        here = current(mod)
        if here is not None and is_linear(mod) and isinstance(out, torch.Tensor):
            rel, f = here
            mode.watch[id(out)] = (rel, out)
            mode.tag(out, frozenset({rel}))
            mode.columns.watch(rel, out)
            f.last_linear[rel.rpartition(".")[0]] = rel
        if id(mod) in block_ids:
            block_calls.append((block_ids[id(mod)], args, kwargs, out))
            if recording and recording[-1] == block_ids[id(mod)]:
                recording.pop()

    handles = []
    for mod in {id(m): m for m in root.modules()}.values():
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    was_training = root.training
    root.eval()
    args = example if isinstance(example, tuple) else (example,)
    opaque = _opaque_moe_on_meta(root)
    try:
        with torch.no_grad():
            mode.__enter__()
            try:
                trace.output = root(*args)
            finally:
                mode.__exit__(None, None, None)
    finally:
        for h in handles:
            h.remove()
        for mod in opaque:
            del mod.forward
        root.train(was_training)
    _analyse_blocks(trace, root, blocks, block_calls)
    _classify_outside(trace, root, blocks_path, events)
    trace.block_attrs = {key: {k: v for k, v in vars(block).items() if not k.startswith("_")
                               and isinstance(v, (int, float, str, bool, type(None)))} for key, block in blocks.items()}
    first = next(iter(blocks))
    done: dict[str, ModelTrace] = {}
    for key, rep in rep_of.items():
        if facts[key].mode is not None:
            done[rep] = facts[key].into(trace) if rep not in done else _completed(done[rep], facts[key].into(trace))
    own = done.get(first)
    if own is not None:
        trace = replace(own, kinds={})
    trace.kinds = {key: done[rep] for key, rep in rep_of.items() if rep != first and rep in done}
    return trace


def _completed(trace: ModelTrace, later: ModelTrace) -> ModelTrace:
    """``trace`` (a kind's first block) with the facts of modules only a later block of its kind ran (its own win)."""
    ran = set(trace.sources) | set(trace.module_sources)

    def fill(mine: dict, theirs: dict) -> dict:
        return {**{k: v for k, v in theirs.items() if k not in mine}, **mine}

    return replace(trace, consumers=fill(trace.consumers, later.consumers), columns=fill(trace.columns, later.columns),
                   score_biases=fill(trace.score_biases, later.score_biases),
                   last_linear=fill(trace.last_linear, later.last_linear), sources=fill(trace.sources, later.sources),
                   module_sources=fill(trace.module_sources, later.module_sources),
                   input_ndim=fill(trace.input_ndim, later.input_ndim),
                   takes_block_input=trace.takes_block_input | {r for r in later.takes_block_input if r not in ran})


def _opaque_moe_on_meta(root: nn.Module) -> list[nn.Module]:
    """On the meta device (a planner dry run) routing has no data: MoE layers pass their input through
    during the trace (their structure is not needed; shapes are kept)."""
    if not any(p.is_meta for p in root.parameters()):
        return []
    layers = [m for m in root.modules() if holds_routed_experts(m) and any(True for _ in m.parameters())]
    for mod in layers:
        mod.forward = lambda x, *args, **kwargs: x  # (B, T, H) -> (B, T, H)
    return layers


def _analyse_blocks(trace: ModelTrace, root: nn.Module, blocks: dict[str, nn.Module], calls: list) -> None:
    cls = type(root).__name__
    keys = tuple(k for k, *_ in calls)
    if keys != tuple(blocks):
        raise ValueError(
            f"{cls}: the blocks of {trace.blocks_path} ran in the order {list(keys)} during one forward; pipeline "
            f"and sequence parallelism need each block called once, in order ({list(blocks)}). Implement "
            f"{' / '.join(hook_call(h) for h in PIPELINE_HOOKS)}."
        )
    trace.block_order = keys
    _, args0, kwargs0, out0 = calls[0]
    tuple_out = len(out0) if isinstance(out0, (tuple, list)) else None
    carrier = out0[0] if tuple_out is not None else out0
    position, keyword = None, None
    if len(calls) > 1:
        _, args1, kwargs1, _ = calls[1]
        position = next((i for i, a in enumerate(args1) if a is carrier), None)
        if position is None:
            keyword = next((k for k, v in kwargs1.items() if v is carrier), None)
    else:
        position = next((i for i, a in enumerate(args0) if isinstance(a, torch.Tensor)), None)
        if position is None:
            keyword = next((k for k, v in kwargs0.items() if isinstance(v, torch.Tensor)), None)
    if position is None and keyword is None:
        raise ValueError(
            f"{cls}: block {trace.blocks_path}.{keys[min(1, len(keys) - 1)]} does not receive the previous block's "
            f"output as an argument, so the hidden state cannot be followed from block to block. Implement "
            f"{hook_call(PIPELINE_SPLIT)} with {hook_call(PIPELINE_PRE)} / {hook_call(PIPELINE_POST)}."
        )
    trace.hidden = HiddenArg(position=position, keyword=keyword, tuple_out=tuple_out)


def _classify_outside(trace: ModelTrace, root: nn.Module, blocks_path: str, events: list[tuple[str, str]]) -> None:
    """Outermost modules outside the blocks (not their ancestors): before, after, or elsewhere."""
    ancestors = {".".join(blocks_path.split(".")[:i]) for i in range(len(blocks_path.split(".")))}
    prefix = blocks_path + "."
    positions = [i for i, (_, p) in enumerate(events) if p.startswith(prefix) and p.count(".") == blocks_path.count(".") + 1]
    first, last = positions[0], positions[-1]
    seen: dict[str, list[int]] = {}
    for i, (_, path) in enumerate(events):
        if path in ancestors or path == blocks_path or path.startswith(prefix):
            continue
        parent = path.rpartition(".")[0]
        if parent not in ancestors:  # not outermost: its ancestor outside the blocks is recorded
            continue
        seen.setdefault(path, []).append(i)
    pre, post, elsewhere = [], [], []
    for path, idx in seen.items():
        if all(i < first for i in idx):
            pre.append(path)
        elif all(i > last for i in idx):
            post.append(path)
        else:
            elsewhere.append(path)
    trace.pre, trace.post, trace.elsewhere = tuple(pre), tuple(post), tuple(elsewhere)
