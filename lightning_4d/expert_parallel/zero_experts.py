"""Zero (identity) experts beside a model's own experts module: what the in-place rewrite accepts and refuses.

LongCat-Flash routes every token over ``E`` real experts and ``Z`` *zero* experts that return their input scaled by
the routing weight and hold no weights. transformers 5.25 computes the identities in the MoE layer and hands its
experts module (stacks ``[E, ...]``) only ids in ``[0, E)``: the router alone has ``E + Z`` rows, which
:func:`zero_expert_router` recognises on the layer's evidence, and the experts module shards like any other (the
layer, identities included, runs as written on each rank's tokens). Earlier transformers 5 releases kept the zero
experts as extra rows of one stack (``gate_up_proj [E + Z, ...]`` beside ``down_proj [E, ...]``) and computed the
identities inside the experts module: :func:`two_sizes_reason` says why that cannot be sharded by expert.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["zero_expert_router", "two_sizes_reason"]


def two_sizes_reason(own: dict[str, nn.Parameter]) -> str:
    """Why expert stacks of two leading sizes are refused (LongCat-Flash in earlier transformers 5 releases keeps
    its zero experts as extra rows of ``gate_up_proj [E+Z, ...]`` beside ``down_proj [E, ...]``). Pure.

    Example:
        >>> two_sizes_reason({"gate_up_proj": nn.Parameter(torch.zeros(6, 4, 2)),
        ...                   "down_proj": nn.Parameter(torch.zeros(4, 2, 2))})[:60]
        'its expert stacks have two leading sizes (gate_up_proj: 6, d'
    """
    e = min(p.shape[0] for p in own.values())
    extra = max(p.shape[0] for p in own.values()) - e
    listed = ", ".join(f"{n}: {p.shape[0]}" for n, p in own.items())
    return (f"its expert stacks have two leading sizes ({listed}): the larger holds {extra} rows beyond the {e} "
            f"experts of the smaller (zero / identity experts kept in the stack, as LongCat-Flash did in earlier "
            f"transformers 5 releases). Expert parallelism shards every stack by expert (Shard(0) over ep), and a "
            f"stack of {e + extra} rows cannot follow the owners of {e} experts, so this module cannot be sharded "
            f"exactly. Fix: keep zero experts out of the stacks and compute them in the layer (a transformers release "
            f"whose LongCat-Flash holds [n_routed_experts, ...] stacks, e.g. 5.25), or use ep=1")


def zero_expert_router(module: nn.Module, parent: nn.Module, e: int) -> Optional[tuple[str, int]]:
    """``(router path, Z)`` when ``parent`` (the MoE layer) routes over ``E + Z`` experts of which ``Z`` are zero
    (identity) experts it handles itself, else ``None``. Pure.

    LongCat-Flash's layer routes over ``n_routed_experts + zero_expert_num``, adds ``hidden · weight`` for the
    zero-expert assignments itself and hands the experts module only ids in ``[0, E)`` (a zero expert's assignment
    becomes a weight-0 one to a real expert), so the experts module is an ordinary ``E``-expert module and the
    zero experts need no weights and no communication. Evidence required (a larger unrelated linear must not pass
    for a router): a sibling of ``module`` holding exactly one 2-D parameter ``(E + Z, H)`` (bias aside), and int
    attributes of ``parent`` equal to ``E`` and to ``Z`` whose names say ``expert`` (``Z``'s also ``zero``). An id
    outside ``[0, E)`` reaching the experts at run time is refused there (see
    :func:`~.inplace.install_expert_parallel`).

    Example:
        >>> class Moe(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.num_routed_experts, self.zero_expert_num = 4, 2
        ...         self.router, self.experts = nn.Linear(8, 6, bias=False), nn.Module()
        >>> moe = Moe()
        >>> zero_expert_router(moe.experts, moe, 4)
        ('router', 2)
    """
    ints = {a: v for a, v in vars(parent).items() if isinstance(v, int) and not isinstance(v, bool)}
    zeros = {v for a, v in ints.items() if "zero" in a and "expert" in a and v > 0}
    if not any(v == e and "expert" in a and "zero" not in a for a, v in ints.items()):
        return None
    for sub, mod in parent.named_modules():
        if not sub or any(m is module for m in mod.modules()):
            continue
        weights = [p for p in mod.parameters(recurse=False) if p.dim() == 2]
        if len(weights) == 1 and weights[0].shape[0] - e in zeros:
            return sub, int(weights[0].shape[0] - e)
    return None
