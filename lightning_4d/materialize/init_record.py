"""Record what an initialiser call writes, without running it on real tensors: the steps of :mod:`init_pieces`.

During a call, each of the model's tensors the call reads from its module is a :class:`RecordingTensor`: a tensor
subclass with the tensor's shape, dtype and device but no memory. Views of it (``w[0]``, ``w.data``, ``w.t()``)
stay recording tensors that know which region they cover; an elementwise in-place op on one (``uniform_``,
``normal_``, ``fill_``, ``zero_``, ``mul_``, ``erfinv_``, ``clamp_``, ``copy_`` from a computed tensor, ...)
becomes a :class:`~lightning_4d.materialize.init_pieces.Step` of that tensor. Random draws take the counter-based draw of
:mod:`init_pieces` (keyed by the run's random seed, the tensor's name and the draw's number); a ``generator`` passed to them is
not used. Anything else that needs the tensor's values (``orthogonal_``'s QR reads none and *is* recorded; a
``w.norm()``, ``w.data = ...``, a copy from one parameter into another) raises :class:`NotReplayable`, and the
caller runs that call on whole tensors instead (:mod:`lightning_4d.materialize.local_shards`).

Example:
    >>> import torch
    >>> rec = Recorder(b"seed", {1: "w"}, torch.device("cpu"))
    >>> w = rec.tensor(1, torch.empty(2, 3, device="meta"))
    >>> with torch.no_grad(), rec.recording():
    ...     _ = torch.nn.init.trunc_normal_(w, std=0.02)
    ...     _ = w[0].zero_()
    >>> [s.kind for s in rec.steps[1]]
    ['trunc_normal', 'fill']
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from lightning_4d._compat import (
    disabled_torch_function, op_is_view, op_schema, pytree, trunc_normal_hook, wrapper_subclass,
)
from lightning_4d.materialize.init_pieces import Region, Step, draw_key

__all__ = ["NotReplayable", "Recorder", "RecordingTensor"]

aten = torch.ops.aten

# Elementwise in-place ops replayed on any set of elements (their other operands: scalars or real tensors).
_ELEMENTWISE = {
    "mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "exp_", "log_", "sqrt_",
    "rsqrt_", "neg_", "abs_", "tanh_", "sigmoid_", "pow_", "reciprocal_", "masked_fill_", "fmod_", "remainder_",
    "floor_", "ceil_", "round_", "trunc_", "sign_", "addcmul_", "addcdiv_", "lerp_", "log1p_", "expm1_",
}
# Ops that only read the metadata of a recording tensor and return a new real tensor.
_LIKE = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"}
_NEW = {"new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"}
_ALIASES = {aten.detach.default, aten.alias.default}


class NotReplayable(RuntimeError):
    """The call uses a tensor's values (or writes it in a way no step describes): run it on whole tensors."""


class RecordingTensor(Tensor):
    """A tensor with shape, dtype and device but no memory, standing for a region of one of the model's tensors
    while an initialiser call is recorded (see the module docstring)."""

    _recorder: "Recorder"
    _key: int
    _meta: Tensor

    @staticmethod
    def __new__(cls, recorder: "Recorder", key: int, meta: Tensor, device: torch.device,
                requires_grad: bool = False) -> "RecordingTensor":
        r = wrapper_subclass(cls, meta, device, requires_grad)
        r._recorder, r._key, r._meta = recorder, key, meta
        return r

    __torch_function__ = disabled_torch_function

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RecordingTensor({self._recorder.names.get(self._key, '?')}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        flat, _ = pytree.tree_flatten((args, kwargs or {}))
        recorder = next(a._recorder for a in flat if isinstance(a, RecordingTensor))
        return recorder.dispatch(func, args, kwargs or {})


class Recorder:
    """Collects the :class:`~lightning_4d.materialize.init_pieces.Step` s of one initialiser call per tensor key.

    ``names``: key -> the tensor's first name in the unsharded model (it keys the random draws with ``seed``);
    ``draws``: key -> draws made into it so far (shared across calls, so each draw has its own number).
    """

    def __init__(self, seed: bytes, names: dict[int, str], device: torch.device,
                 draws: Optional[dict[int, int]] = None) -> None:
        self.seed, self.names, self.device = seed, names, device
        self.draws = draws if draws is not None else {}
        self.steps: dict[int, list[Step]] = {}
        self._numel: dict[int, int] = {}

    def tensor(self, key: int, meta: Tensor, parameter: bool = False) -> Tensor:
        """A recording tensor standing for the whole tensor ``key`` (``meta``: its meta-device twin)."""
        self._numel[key] = meta.numel()
        rec = RecordingTensor(self, key, meta.detach(), self.device)
        if parameter:
            return torch.nn.Parameter(rec, requires_grad=meta.requires_grad)
        return rec

    # ---------------------------------------------------------------------------------------------- dispatch
    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = func.overloadpacket.__name__
        flat, _ = pytree.tree_flatten((args, kwargs))
        recs = [a for a in flat if isinstance(a, RecordingTensor)]
        first = args[0] if args else None
        if (op_is_view(func) or func in _ALIASES) and isinstance(first, RecordingTensor) and len(recs) == 1:
            out = func(*pytree.tree_map(_meta_of, args), **pytree.tree_map(_meta_of, kwargs))
            return pytree.tree_map(lambda o: RecordingTensor(self, first._key, o, self.device) if isinstance(o, Tensor)
                            else o, out)
        if name in _NEW and isinstance(first, RecordingTensor):
            return func(torch.empty(0, dtype=first.dtype, device=self.device), *args[1:], **kwargs)
        if name in _LIKE and isinstance(first, RecordingTensor):
            return func(torch.empty(first.shape, dtype=first.dtype, device=self.device), *args[1:], **kwargs)
        if name.endswith("_") and isinstance(first, RecordingTensor) and len(recs) == 1:
            self._record(func, name, first, args, kwargs)
            return first
        raise NotReplayable(f"{func} uses the values of {self.names.get(recs[0]._key, 'a tensor')}")

    def _record(self, func: Any, name: str, target: RecordingTensor, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> None:
        meta = target._meta
        region = Region(meta.storage_offset(), tuple(meta.shape), tuple(meta.stride()), self._numel[target._key])
        if not region.nested():
            raise NotReplayable(f"{func} writes an overlapping view of {self.names[target._key]}")
        bound = _bound(func, args, kwargs)
        if name == "uniform_":
            step = Step("uniform", region, args=(float(bound["from"]), float(bound["to"])),
                        key=self._draw(target._key))
        elif name == "normal_":
            step = Step("normal", region, args=(float(bound["mean"]), float(bound["std"])),
                        key=self._draw(target._key))
        elif name == "fill_":
            value = bound["value"]
            step = Step("fill", region, args=(value.item() if isinstance(value, Tensor) else value,))
        elif name == "zero_":
            step = Step("fill", region, args=(0,))
        elif name == "copy_":
            src = bound["src"]
            step = Step("copy", region, src=src.detach().clone()) if src.dim() else \
                Step("fill", region, args=(src.item(),))
        elif name in _ELEMENTWISE:
            rest = tuple(a.detach().clone() if isinstance(a, Tensor) else a for a in args[1:])
            step = Step("inplace", region, args=rest, kwargs=dict(kwargs), func=func)
        else:
            raise NotReplayable(f"{func} on {self.names[target._key]} is not an elementwise write")
        self.steps.setdefault(target._key, []).append(step)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Inside: ``torch.nn.init.trunc_normal_`` on a recording tensor is one ``"trunc_normal"`` step (torch's
        own rejection loop reads the values it drew)."""
        def hook(tensor: Tensor, mean: float, std: float, a: float, b: float, generator: Any, original: Any) -> Any:
            if not isinstance(tensor, RecordingTensor):
                return original(tensor, mean, std, a, b, generator=generator)
            meta = tensor._meta
            region = Region(meta.storage_offset(), tuple(meta.shape), tuple(meta.stride()), self._numel[tensor._key])
            self.steps.setdefault(tensor._key, []).append(
                Step("trunc_normal", region, args=(float(mean), float(std), float(a), float(b)),
                     key=self._draw(tensor._key)))
            return tensor

        with trunc_normal_hook(hook):
            yield

    def _draw(self, key: int) -> int:
        n = self.draws.get(key, 0)
        self.draws[key] = n + 1
        return draw_key(self.seed, self.names[key], n)


def _meta_of(a: Any) -> Any:
    return a._meta if isinstance(a, RecordingTensor) else a


def _bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``func``'s arguments by name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(op_schema(func).arguments):
        if i < len(args):
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
