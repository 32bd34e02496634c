"""Following a linear's output features through the traced forward: where the model cuts and groups them.

Inside the first block of each kind, :class:`_Columns` follows every linear's output through the ops that keep its
features addressable (layout ops, ``split`` / ``chunk`` / slices along the features, per-head ``view`` calls,
depthwise convolutions along the sequence, per-feature scales) and records a
:class:`~lightning_4d.analysis.trace_records.ColumnLayout` per linear. The torch-function mode of
:mod:`lightning_4d.analysis.trace_consumers` feeds it every op; tensor parallelism shards each linear along those layouts.

Example:
    >>> import torch
    >>> cols = _Columns()
    >>> qkv = torch.zeros(2, 3, 48)
    >>> cols.watch("attn.qkv", qkv)
    >>> pieces = qkv.split(16, dim=-1)
    >>> cols.follow("split", (qkv, 16, -1), {}, pieces)
    >>> sorted(cols.layouts["attn.qkv"].cuts)
    [(0, 16), (16, 32), (32, 48)]
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_4d.analysis.trace_records import SPLIT_OPS, ColumnLayout

__all__: list[str] = []  # internals of lightning_4d.analysis.trace, imported by name

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
