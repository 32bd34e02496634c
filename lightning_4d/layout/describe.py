"""What a rewritten model holds on this rank, one row per parameter: :func:`describe_layout` (logged by the strategy at
set-up; golden-tested for a few families). Re-exported by :mod:`lightning_4d.layout.parallelize`.

Example:
    >>> [str(r) for r in describe_layout(nn.Linear(2, 3, bias=False))]
    ['weight [3, 2] -> [3, 2] [whole]']
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement

__all__ = ["LayoutRow", "describe_layout"]


@dataclass(frozen=True)
class LayoutRow:
    """Where one parameter of the rewritten model lives on this rank: its global shape, the mesh dimensions
    and placements of its DTensor (``()`` for a plain tensor held whole), and the local shard's shape.

    Example:
        >>> describe_layout(nn.Linear(2, 3))[0]
        LayoutRow(name='bias', shape=(3,), mesh=(), placements=(), local=(3,))
    """

    name: str
    shape: tuple[int, ...]
    mesh: tuple[str, ...]
    placements: tuple[str, ...]
    local: tuple[int, ...]

    def __str__(self) -> str:
        where = ", ".join(f"{m}:{p}" for m, p in zip(self.mesh, self.placements)) or "whole"
        return f"{self.name} {list(self.shape)} -> {list(self.local)} [{where}]"


def describe_layout(module: nn.Module) -> list[LayoutRow]:
    """The layout this rank holds, one row per parameter in name order (works on the meta device: it is the
    plan, computed without weights). Logged by the strategy at set-up; golden-tested for a few families.

    Example:
        >>> [str(r) for r in describe_layout(nn.Linear(2, 3, bias=False))]
        ['weight [3, 2] -> [3, 2] [whole]']
    """
    rows = []
    for name, p in sorted(module.named_parameters(), key=lambda item: item[0]):
        if isinstance(p, DTensor):
            names = tuple(p.device_mesh.mesh_dim_names or ())
            rows.append(LayoutRow(name, tuple(p.shape), names, tuple(_placement(x) for x in p.placements),
                                  tuple(p.to_local().shape)))
        else:
            rows.append(LayoutRow(name, tuple(p.shape), (), (), tuple(p.shape)))
    return rows


def _placement(p: Placement) -> str:
    if isinstance(p, Partial):
        return "P"
    dim = getattr(p, "dim", None)
    if dim is None:
        return "R"
    return f"S({dim})" if type(p).__name__ == "Shard" else f"{type(p).__name__.lstrip('_')}({dim})"
