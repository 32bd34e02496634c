"""Tensor-parallel styles as values: what a layout plan stores per module, and the ``ParallelStyle`` it makes.

A :class:`StyleSpec` is a style's class name and its constructor options (plain data: numbers, strings,
placements written ``"R"`` / ``"S(1)"`` / ``"P"``), so a plan can be printed, compared, saved as JSON and edited
by hand. :func:`spec_of` reads one back from a style object (the package's own styles and torch's
``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` / ``PrepareModuleInput`` / ``PrepareModuleOutput``,
e.g. from a user's ``fourd_tp_plan``); :meth:`StyleSpec.build` makes the object when the plan is applied. A style
of another class is kept as the object itself (``kind="object"``): it applies, but a plan holding one cannot be
saved (:meth:`StyleSpec.to_data` says which).

Example:
    >>> spec = StyleSpec("Rowwise", (("output_layouts", "S(1)"), ("sequence", False)))
    >>> str(spec), type(spec.build()).__name__
    ('Rowwise(output_layouts=S(1))', 'Rowwise')
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.tensor_parallel.styles import (
    Colwise,
    DistributedNorm,
    GatheredColumns,
    LowRankDown,
    RegionInput,
    Rowwise,
)

__all__ = ["StyleSpec", "placement_from_str", "placement_str", "spec_of"]

# class -> (its option names, their defaults: left out of the printed form)
_OPTIONS: dict[type, dict[str, Any]] = {
    Colwise: {"permutation": None, "partial_input": False, "sequence": False},
    Rowwise: {"output_layouts": "R", "sequence": False},
    LowRankDown: {},
    GatheredColumns: {"rows": None},
    RegionInput: {"sequence_parallel": None, "rows": ()},
    DistributedNorm: {},
    ColwiseParallel: {"input_layouts": "R", "output_layouts": "S(-1)", "use_local_output": True},
    RowwiseParallel: {"input_layouts": "S(-1)", "output_layouts": "R", "use_local_output": True},
    SequenceParallel: {"sequence_dim": 1, "use_local_output": False},
    PrepareModuleInput: {"input_layouts": None, "desired_input_layouts": None, "input_kwarg_layouts": None,
                         "desired_input_kwarg_layouts": None, "use_local_output": False},
    PrepareModuleOutput: {"output_layouts": None, "desired_output_layouts": None, "use_local_output": True},
}
_CLASSES = {cls.__name__: cls for cls in _OPTIONS}
_PLACEMENT = re.compile(r"^S\((-?\d+)\)$")


def placement_str(p: Optional[Placement]) -> Optional[str]:
    """``Replicate()`` → ``"R"``, ``Shard(1)`` → ``"S(1)"``, ``Partial()`` → ``"P"``; ``None`` stays ``None``.

    Example:
        >>> placement_str(Shard(-1)), placement_str(Replicate())
        ('S(-1)', 'R')
    """
    if p is None:
        return None
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    raise ValueError(f"placement {p!r} has no written form (Replicate, Shard(d) or Partial)")


def placement_from_str(text: Optional[str]) -> Optional[Placement]:
    """The inverse of :func:`placement_str`.

    Example:
        >>> placement_from_str("S(1)"), placement_from_str("R")
        (Shard(dim=1), Replicate())
    """
    if text is None:
        return None
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    match = _PLACEMENT.match(text)
    if match is None:
        raise ValueError(f"placement {text!r}: write 'R' (replicate), 'P' (partial) or 'S(d)' (shard dim d)")
    return Shard(int(match.group(1)))


def _encode(value: Any) -> Any:
    if isinstance(value, Placement):
        return placement_str(value)
    if isinstance(value, (list, tuple)):
        return tuple(_encode(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _encode(v)) for k, v in value.items()))
    return value


def _decode(name: str, value: Any, cls: type) -> Any:
    if cls is RegionInput and name == "rows":  # {parameter path: rows of every rank}
        return {k: [list(r) for r in v] for k, v in value or ()}
    if name == "permutation" or name == "rows":
        if value is None:
            return None
        return [list(v) for v in value] if name == "rows" else list(value)
    if name.endswith("kwarg_layouts"):
        return None if value is None else {k: placement_from_str(v) for k, v in value}
    if name.endswith("layouts"):
        if isinstance(value, (list, tuple)):
            return tuple(placement_from_str(v) for v in value)
        return placement_from_str(value)
    return value


@dataclass(frozen=True)
class StyleSpec:
    """One module's tensor-parallel style as data: ``kind`` (the style class) and its options.

    Example:
        >>> StyleSpec("Colwise").build().permutation is None
        True
    """

    kind: str
    options: tuple[tuple[str, Any], ...] = ()
    obj: Optional[ParallelStyle] = field(default=None, compare=False)  # kind == "object": a style kept as is

    def option(self, name: str, default: Any = None) -> Any:
        """One option's (encoded) value."""
        return dict(self.options).get(name, default)

    def build(self) -> ParallelStyle:
        """The ``ParallelStyle`` this spec describes (a fresh object each call)."""
        if self.kind == "object":
            assert self.obj is not None
            return self.obj
        cls = _CLASSES.get(self.kind)
        if cls is None:
            raise ValueError(f"tensor-parallel style {self.kind!r} is unknown; known: {', '.join(sorted(_CLASSES))}")
        known = _OPTIONS[cls]
        wrong = [k for k, _ in self.options if k not in known]
        if wrong:
            raise ValueError(f"style {self.kind} has no option {wrong[0]!r}; its options: {', '.join(known) or 'none'}")
        return cls(**{k: _decode(k, v, cls) for k, v in self.options})

    def __str__(self) -> str:
        if self.kind == "object":
            return f"{type(self.obj).__name__}(...)"
        defaults = _OPTIONS.get(_CLASSES.get(self.kind, object), {})
        shown = []
        for k, v in self.options:
            if k in defaults and v == defaults[k]:
                continue
            shown.append(f"{k}={'<%d rows>' % len(v) if k == 'permutation' else _short(v)}")
        return f"{self.kind}({', '.join(shown)})"

    def to_data(self, where: str = "") -> dict[str, Any]:
        """A JSON-ready dict; a kept style object cannot be written and raises naming the module."""
        if self.kind == "object":
            raise ValueError(
                f"{where or 'a module'}: its style {type(self.obj).__name__} (from {hook_call(TP_PLAN)}) has no written "
                f"form, so this plan cannot be saved. Use one of {', '.join(sorted(_CLASSES))}."
            )
        return {"kind": self.kind, **{k: _jsonable(v) for k, v in self.options}}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> "StyleSpec":
        """The inverse of :meth:`to_data`."""
        rest = {k: v for k, v in data.items() if k != "kind"}
        return cls(str(data["kind"]), tuple((k, _encode_json(v)) for k, v in rest.items()))


def _short(v: Any) -> str:
    if isinstance(v, tuple) and len(v) > 6:
        return f"<{len(v)} entries>"
    return str(v).replace("'", "") if not isinstance(v, str) else v


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


def _encode_json(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_encode_json(x) for x in v)
    return v


def spec_of(style: ParallelStyle) -> StyleSpec:
    """The :class:`StyleSpec` of a style object (its class's options read back); an unknown class is kept as is.

    Example:
        >>> str(spec_of(ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)))
        'ColwiseParallel(use_local_output=False)'
    """
    cls = type(style)
    if cls not in _OPTIONS:
        return StyleSpec("object", obj=style)
    options = [(name, _encode(_read(style, name))) for name in _OPTIONS[cls]]
    return StyleSpec(cls.__name__, tuple(options))


def _read(style: ParallelStyle, name: str) -> Any:
    """One constructor option of ``style`` as torch stores it (some under other names, or wrapped in a tuple)."""
    if isinstance(style, SequenceParallel) and name == "sequence_dim":
        return style.sequence_shardings[0].dim if hasattr(style, "sequence_shardings") else style.sequence_sharding[0].dim
    value = getattr(style, name, None)
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and isinstance(value, tuple) and len(value) == 1:
        return value[0]  # a single placement, as the constructor takes it
    if isinstance(style, PrepareModuleInput) and name.endswith("kwarg_layouts") and value == {}:
        return None
    if isinstance(style, GatheredColumns) and name == "rows":
        return tuple(tuple(r) for r in value)
    return value
