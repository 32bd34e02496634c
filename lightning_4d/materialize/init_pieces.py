"""Layout-independent initial values, computed for any set of elements: counter-based draws and replayed steps.

A meta-built model's initial values are a function of the run's seed and each tensor's name, never of the layout.
An initialiser call (``reset_parameters``, ``init_weights``, a Hugging Face ``_init_weights``) is recorded once as
a list of :class:`Step` per tensor (:mod:`lightning_4d.materialize.init_record`): which region of the tensor it writes and how
(a random draw, a fill, an elementwise in-place op, a copy from a small computed tensor). A step is a pure function
of the element's *position in the unsharded tensor*: a random draw for position ``p`` is ``mix64(key + (p+1)·γ)``
(SplitMix64's output function; ``key`` from the run's random seed, the tensor's name and the draw's number), so any rank can
compute exactly its own elements, in any order and any chunking, and gets the bits one process gets.

A rank computes at most :data:`CHUNK_ELEMENTS` elements at a time; what it holds beyond its share while doing so is
:func:`scratch_bytes`, the one owner of that number (the planner's set-up term imports it).

Example:
    >>> r = Region.whole_of((2, 3))
    >>> step = Step("normal", r, args=(0.0, 1.0), key=draw_key(b"seed", "w", 0))
    >>> full = torch.full((6,), float("nan")); evaluate([step], torch.arange(6), full)
    >>> part = torch.full((2,), float("nan")); evaluate([step], torch.tensor([4, 1]), part)
    >>> torch.equal(part, full[[4, 1]])
    True
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["CHUNK_ELEMENTS", "SCRATCH_BYTES_PER_ELEMENT", "Region", "Step", "covers", "draw_key", "evaluate", "live_steps",
           "normal01", "scratch_bytes", "uniform01", "unwritten_fill"]

CHUNK_ELEMENTS = 1 << 16  # elements of a rank's shard computed at once (smaller chunks stay in cache: faster too)
# Peak bytes per element of a chunk (positions, counter hashes, float64 draws and their temporaries, the step's
# masks, allocator slack): measured 130-170 by ``bench/bench_moe_setup.py --scratch``, which checks this bound.
SCRATCH_BYTES_PER_ELEMENT = 192


def scratch_bytes() -> int:
    """Bytes one rank holds beyond its share while it initialises its shards (one chunk's working set).

    Example:
        >>> scratch_bytes() < 256 << 20
        True
    """
    return CHUNK_ELEMENTS * SCRATCH_BYTES_PER_ELEMENT


def draw_key(seed: bytes, name: str, draw: int) -> int:
    """The 64-bit key of draw number ``draw`` into the tensor called ``name`` (its first name in the unsharded
    model), for the run's ``seed`` (a digest of the random state every rank shares).

    Example:
        >>> draw_key(b"s", "w", 0) != draw_key(b"s", "w", 1)
        True
    """
    digest = hashlib.sha256(seed + b"\0" + name.encode() + b"\0" + str(draw).encode()).digest()
    return int.from_bytes(digest[:8], "little")


_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _bits(key: int, positions: Tensor) -> np.ndarray:
    """64 random bits per position: SplitMix64's output function of ``key + (position + 1)·γ`` (mod 2^64)."""
    z = positions.detach().cpu().numpy().astype(np.uint64)  # (N,) non-negative int64 -> the same bits
    z += np.uint64(1)
    z *= _GAMMA
    z += np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def uniform01(key: int, positions: Tensor) -> Tensor:
    """Uniform ``[0, 1)`` float64 values with 53 random bits, one per position.

    Example:
        >>> u = uniform01(7, torch.arange(1000)); bool((u >= 0).all() and (u < 1).all())
        True
    """
    z = _bits(key, positions)
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)


def normal01(key: int, positions: Tensor) -> Tensor:
    """Standard normal float64 values, one per position (Box–Muller on the two 32-bit halves of one draw).

    Example:
        >>> z = normal01(7, torch.arange(100_000)); abs(float(z.mean())) < 0.02, abs(float(z.std()) - 1) < 0.02
        (True, True)
    """
    halves = _bits(key, positions).view(np.uint32)  # (2N,): [low, high] per draw (little endian)
    if sys.byteorder != "little":
        halves = halves.reshape(-1, 2)[:, ::-1].reshape(-1)
    u1 = torch.from_numpy(halves[1::2].astype(np.float64)).add_(1.0).mul_(2.0 ** -32)  # (0, 1]
    u2 = torch.from_numpy(halves[0::2].astype(np.float64)).mul_(2.0 ** -32)  # [0, 1)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2.0 * math.pi).cos_())  # in place: no temporaries


def unwritten_fill(t: Tensor) -> None:
    """Fill ``t`` with the value that marks "not written": NaN for floating point, the smallest integer otherwise.

    Example:
        >>> t = torch.zeros(2); unwritten_fill(t); bool(t.isnan().all())
        True
    """
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


@dataclass(frozen=True)
class Region:
    """The elements a view of a contiguous tensor of ``numel_full`` elements covers: its storage ``offset``,
    ``sizes`` and ``strides`` (in elements). Views made by select, slice (any step), narrow, transpose, view or
    unsqueeze of the whole tensor are "nested" (:meth:`nested`), so a position maps back to at most one index.

    Example:
        >>> r = Region(3, (2,), (1,), 6)          # row 1 of a (2, 3) tensor, first two columns
        >>> mask, idx = r.locate(torch.arange(6)); mask.tolist()
        [False, False, False, True, True, False]
    """

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    numel_full: int

    @staticmethod
    def whole_of(shape: Sequence[int]) -> "Region":
        """The whole contiguous tensor of ``shape``.

        Example:
            >>> Region.whole_of((2, 3)).whole
            True
        """
        strides, acc = [], 1
        for s in reversed(list(shape)):
            strides.append(acc)
            acc *= s
        return Region(0, tuple(shape), tuple(reversed(strides)), math.prod(shape))

    @property
    def numel(self) -> int:
        """Elements of the view."""
        return math.prod(self.sizes)

    @property
    def whole(self) -> bool:
        """Whether the view covers every element of the tensor."""
        return self.numel == self.numel_full and self.nested()

    def span(self) -> tuple[int, int]:
        """The smallest and largest position the view touches (``(0, -1)`` when empty)."""
        if self.numel == 0:
            return 0, -1
        extent = sum((s - 1) * st for s, st in zip(self.sizes, self.strides))
        return self.offset, self.offset + extent

    def _order(self) -> list[int]:
        return sorted((d for d, s in enumerate(self.sizes) if s > 1), key=lambda d: -self.strides[d])

    def nested(self) -> bool:
        """Whether each stride exceeds the extent of all smaller ones (no overlap; positions map back uniquely)."""
        extent = 0
        for d in reversed(self._order()):
            if self.strides[d] <= extent:
                return False
            extent += (self.sizes[d] - 1) * self.strides[d]
        return all(st >= 0 for st in self.strides)

    def box(self, shape: Sequence[int]) -> Optional[list[tuple[int, int]]]:
        """The view as ``[start, stop)`` per dimension of the full tensor of ``shape`` when it is an axis-aligned
        block (slices of step 1, selects, narrows: every view dimension strides like one full dimension, in order),
        else ``None``.

        Example:
            >>> Region(3, (2,), (1,), 6).box((2, 3)), Region(0, (2,), (2,), 4).box((4,))
            ([(1, 2), (0, 2)], None)
        """
        full = Region.whole_of(shape).strides
        if self.numel == 0:
            return [(0, 0)] * len(shape)
        dims: dict[int, int] = {}
        last = -1
        for size, stride in zip(self.sizes, self.strides):
            if size == 1:
                continue
            if stride not in full:
                return None
            d = full.index(stride)
            while d + 1 < len(full) and full[d + 1] == stride:  # several full dimensions of size 1 share a stride
                d += 1
            if d <= last or d in dims:
                return None
            dims[d], last = size, d
        box, rest = [], self.offset
        for d, stride in enumerate(full):
            start, rest = divmod(rest, stride) if stride else (0, rest)
            stop = start + dims.get(d, 1)
            if stop > shape[d]:
                return None
            box.append((start, stop))
        return box if rest == 0 else None

    def locate(self, positions: Tensor, indices: bool = True,
               bounds: Optional[tuple[int, int]] = None) -> tuple[Optional[Tensor], list[Optional[Tensor]]]:
        """``(mask, index)``: which ``positions`` the view covers (``None``: all) and, for those, their index along
        each of the view's dimensions (``None`` for a dimension of size 1: index 0; all ``None`` unless
        ``indices``). ``bounds``: ``(min, max)`` of ``positions`` when the caller knows them."""
        index: list[Optional[Tensor]] = [None] * len(self.sizes)
        if list(self.strides) == list(Region.whole_of(self.sizes).strides):  # one contiguous range of positions
            lo, hi = bounds if bounds is not None else (int(positions.min()), int(positions.max()))
            inside = self.offset <= lo and hi < self.offset + self.numel
            mask = None if inside else (positions >= self.offset) & (positions < self.offset + self.numel)
            if not indices:
                return mask, index
            rest = (positions if mask is None else positions[mask]) - self.offset
            for d in reversed(range(len(self.sizes))):
                if self.sizes[d] > 1:
                    index[d] = rest % self.sizes[d]
                    rest = rest // self.sizes[d]
            return mask, index
        q = positions - self.offset
        mask = q >= 0
        for d in self._order():
            i = torch.div(q, self.strides[d], rounding_mode="floor")
            mask &= (i >= 0) & (i < self.sizes[d])
            q = q - i * self.strides[d]
            index[d] = i
        mask &= q == 0
        if not indices:
            return mask, [None] * len(self.sizes)
        return mask, [None if i is None else i[mask] for i in index]


@dataclass(frozen=True)
class Step:
    """One write of an initialiser into a region of a tensor, replayable on any set of its elements.

    ``kind``: ``"uniform"`` (``args = (low, high)``), ``"normal"`` (``(mean, std)``), ``"trunc_normal"``
    (``(mean, std, a, b)``: the normal truncated to ``[a, b]``, by its inverse CDF), ``"fill"`` (``(value,)``),
    ``"copy"`` (``src``: a real tensor broadcast to the region), ``"inplace"`` (``func``: an elementwise in-place
    ATen op such as ``mul_``, ``erfinv_``, ``clamp_``, applied with ``args``/``kwargs``; tensor operands are real
    tensors broadcast to the region). ``key``: the draw's key (:func:`draw_key`) for random kinds.

    Example:
        >>> Step("fill", Region.whole_of((2,)), args=(0.0,)).defines
        True
    """

    kind: str
    region: Region
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    func: Any = None
    src: Optional[Tensor] = None
    key: int = 0

    @property
    def defines(self) -> bool:
        """Whether the step sets its elements regardless of their earlier value."""
        return self.kind in ("uniform", "normal", "trunc_normal", "fill", "copy")


def live_steps(steps: Sequence[Step]) -> list[Step]:
    """``steps`` from the last one that defines the whole tensor on (the earlier ones are overwritten): what
    :func:`evaluate` needs for the same bits. A model's constructor and its ``init_weights`` often draw every weight
    several times (the package's Llama: ``nn.Linear``'s kaiming-uniform, then a normal twice); only the last draw
    is computed. The draws keep their keys, so the skipped ones change no later draw.

    Example:
        >>> whole = Region.whole_of((4,))
        >>> [s.kind for s in live_steps([Step("uniform", whole, (0, 1)), Step("normal", whole, (0, 1)),
        ...                               Step("fill", Region(0, (2,), (1,), 4), (0.0,))])]
        ['normal', 'fill']
    """
    last = max((i for i, s in enumerate(steps) if s.defines and s.region.whole), default=0)
    return list(steps[last:])


def _gather(src: Tensor, sizes: tuple[int, ...], index: list[Optional[Tensor]], count: int) -> Tensor:
    """``src`` broadcast to ``sizes``, at the view indices ``index`` (one value per located position)."""
    base = src.contiguous()
    expanded = base.expand(sizes)  # stride 0 along broadcast dimensions
    flat = torch.zeros(count, dtype=torch.long)
    for d, i in enumerate(index):
        if i is not None and expanded.stride(d):
            flat += i * expanded.stride(d)
    return base.reshape(-1)[flat]


def covers(regions: Sequence[Region], shape: Sequence[int], max_cells: int = 1 << 20) -> Optional[bool]:
    """Whether axis-aligned ``regions`` (:meth:`Region.box`) together cover every element of a tensor of ``shape``,
    decided on the grid their boundaries cut the tensor into (no per-element work); ``None`` when a region is not a
    block or the grid exceeds ``max_cells``.

    Example:
        >>> halves = [Region(0, (1, 3), (3, 1), 6), Region(3, (1, 3), (3, 1), 6)]
        >>> covers(halves, (2, 3)), covers(halves[:1], (2, 3))
        (True, False)
    """
    boxes = [r.box(shape) for r in regions]
    if any(b is None for b in boxes):
        return None
    cuts = [sorted({0, size, *(v for b in boxes for v in b[d])}) for d, size in enumerate(shape)]  # type: ignore[index]
    if math.prod(max(len(c) - 1, 1) for c in cuts) > max_cells:
        return None
    grids = [torch.tensor(c[:-1], dtype=torch.long) for c in cuts]  # each cell's first index, per dimension
    if any(g.numel() == 0 for g in grids):
        return True  # an empty tensor
    mesh = torch.meshgrid(*grids, indexing="ij") if grids else []
    hit = torch.zeros(mesh[0].shape if mesh else (), dtype=torch.bool)
    for b in boxes:
        inside = torch.ones_like(hit)
        for d, (lo, hi) in enumerate(b):  # type: ignore[union-attr]
            inside &= (mesh[d] >= lo) & (mesh[d] < hi)
        hit |= inside
    return bool(hit.all())


def evaluate(steps: Sequence[Step], positions: Tensor, values: Tensor) -> None:
    """Apply ``steps`` in order to ``values`` (one element per position of the unsharded tensor, in ``positions``'
    order), in place: the elements a single process would hold after the same initialiser calls.

    Example:
        >>> v = torch.zeros(3); evaluate([Step("fill", Region(1, (2,), (1,), 3), args=(5.0,))], torch.arange(3), v)
        >>> v.tolist()
        [0.0, 5.0, 5.0]
    """
    if not positions.numel():
        return
    pmin, pmax = int(positions.min()), int(positions.max())
    for step in steps:
        lo, hi = step.region.span()
        if hi < pmin or lo > pmax:
            continue
        operands = step.kind == "copy" or any(isinstance(a, Tensor) and a.dim() for a in step.args)
        mask, index = step.region.locate(positions, indices=operands, bounds=(pmin, pmax))
        where = positions if mask is None else positions[mask]
        if not where.numel():
            continue
        if step.kind == "uniform":
            low, high = step.args
            new = low + (high - low) * uniform01(step.key, where)
        elif step.kind == "normal":
            mean, std = step.args
            new = mean + std * normal01(step.key, where)
        elif step.kind == "trunc_normal":  # inverse CDF of the normal truncated to [a, b]
            mean, std, a, b = step.args
            lo, hi = (math.erf((a - mean) / std / math.sqrt(2)) + 1) / 2, (math.erf((b - mean) / std / math.sqrt(2)) + 1) / 2
            u = lo + (hi - lo) * uniform01(step.key, where)
            new = (torch.special.erfinv(2 * u - 1) * (std * math.sqrt(2)) + mean).clamp_(a, b)
        elif step.kind == "fill":
            new = torch.full((where.numel(),), step.args[0], dtype=values.dtype)
        elif step.kind == "copy":
            assert step.src is not None
            new = _gather(step.src.cpu(), step.region.sizes, index, where.numel())
        else:  # an elementwise in-place op on the current values
            new = (values if mask is None else values[mask.to(values.device)]).clone()
            args = [_gather(a.cpu(), step.region.sizes, index, where.numel()).to(new.device)
                    if isinstance(a, Tensor) and a.dim() else a for a in step.args]
            step.func(new, *args, **step.kwargs)
        new = new.to(values.device, values.dtype)
        if mask is None:
            values.copy_(new)
        else:
            values[mask.to(values.device)] = new
