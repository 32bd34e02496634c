"""What the set-up value check's reduced copy keeps: blocks at their own positions, stand-ins everywhere else.

Models pick a layer's configuration by its position in the blocks container: Gemma 4 reads
``config.layer_types[i]`` for the mask and rotary table of layer ``i``, ``config.per_layer_config[i]`` for its head
width and ``per_layer_inputs[:, :, i]`` for its per-layer input; hybrids read ``layers[i].block_type``. A reduced
copy that renumbered its kept blocks would hand them another layer's configuration. So the copy keeps every
position:

- the kept blocks (:func:`kept_blocks`: the first block of each distinct structure, :func:`block_signature`, and
  the first block of every pipeline stage) stay where they are, real;
- every other position holds a :class:`StandIn`: no parameters, the block's plain attributes (what the model's
  loop reads), and a forward that returns the hidden state it receives plus a small, fixed function of every
  other tensor it receives (masks, rotary tables, per-layer inputs: :func:`probe_value`), so a stage that hands
  a later block a wrong argument changes the output even where that block is not kept;
- the plan keeps its block order and stages (the real stage boundaries are checked); its rewrite entries for the
  stood-in blocks are dropped (:func:`plan_for_kept`).

Memory: the modules outside the blocks (vocabulary cut) and the kept blocks, unsharded, and their rewritten copy.
When that exceeds the check's budget the kept blocks are checked in passes, one block each, every other position
a stand-in (:func:`check_passes`); only a model one of whose blocks alone exceeds the budget is left unchecked.

Example:
    >>> from lightning_4d.analysis.trace import HiddenArg
    >>> net = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)]))
    >>> stand_in_blocks(net, "0", {"0"}, HiddenArg(), {})
    >>> [type(b).__name__ for b in net[0]], sum(p.numel() for p in net.parameters())
    (['Linear', 'StandIn', 'StandIn'], 6)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_4d._compat import child_modules, own_tensors, registered_submodule
from lightning_4d.analysis.trace import HiddenArg
from lightning_4d.plan import LayoutPlan

__all__ = ["StandIn", "block_signature", "check_passes", "distinct_blocks", "kept_blocks", "plan_for_kept",
           "probe_value", "stand_in_blocks"]

Signature = tuple[tuple[str, Union[str, tuple[int, ...], int, float, bool]], ...]
PROBE_SCALE = 0.1  # what a stand-in adds to the hidden state: at most 0.2 in size, far above any rounding


def block_signature(block: nn.Module, ignore: frozenset[str] = frozenset()) -> Signature:
    """What makes two blocks rewrite differently: every submodule's name and type, every tensor's name and
    shape, and the plain (int / float / str / bool) attributes of every submodule (sliding windows, attention
    types, MoE or dense), as a hashable tuple; attribute keys in ``ignore`` (per-layer indices) left out.

    Example:
        >>> block_signature(nn.Linear(2, 3)) == block_signature(nn.Linear(2, 3)), block_signature(nn.Linear(2, 4))[0]
        (True, ('', 'Linear'))
    """
    parts: list[tuple[str, Union[str, tuple[int, ...], int, float, bool]]] = []
    for name, mod in block.named_modules():
        parts.append((name, type(mod).__name__))
        parts += [(f"{name}.{k}", tuple(t.shape)) for k, t, _ in own_tensors(mod) if t is not None]
        parts += [(key, v) for key, v in _plain_attributes(name, mod) if key not in ignore]
    return tuple(parts)


def _plain_attributes(name: str, mod: nn.Module) -> list[tuple[str, Union[int, float, str, bool]]]:
    return [(f"{name}.{k}", v) for k, v in sorted(vars(mod).items())
            if not k.startswith("_") and k != "training" and isinstance(v, (int, float, str, bool))]


def _index_attributes(blocks: Sequence[nn.Module]) -> frozenset[str]:
    """Attribute keys whose value differs in every block (a layer index, a depth-scaled init std): left out of
    the signatures, or every block would count as distinct."""
    values: dict[str, set[Union[int, float, str, bool]]] = {}
    for block in blocks:
        for name, mod in block.named_modules():
            for key, v in _plain_attributes(name, mod):
                values.setdefault(key, set()).add(v)
    return frozenset(k for k, v in values.items() if len(blocks) > 1 and len(v) == len(blocks))


def distinct_blocks(blocks: Sequence[nn.Module]) -> list[int]:
    """Positions of the first block of every distinct :func:`block_signature` (sliding and global attention, MoE
    and dense layers are each represented), in order.

    Example:
        >>> distinct_blocks([nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 3)])
        [0, 2]
    """
    seen: set[Signature] = set()
    ignore = _index_attributes(blocks)
    chosen = []
    for i, block in enumerate(blocks):
        sig = block_signature(block, ignore)
        if sig not in seen:
            seen.add(sig)
            chosen.append(i)
    return chosen


def kept_blocks(blocks: Sequence[nn.Module], stage_starts: Sequence[int] = ()) -> list[int]:
    """Positions the reduced copy keeps real: the first block of every distinct structure and the first block of
    every pipeline stage (``stage_starts``), in order.

    Example:
        >>> kept_blocks([nn.Linear(2, 2)] * 3 + [nn.Linear(2, 3)], stage_starts=[0, 2])
        [0, 2, 3]
    """
    return sorted(set(distinct_blocks(blocks)) | set(stage_starts))


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors in ``value``, through tuples and lists only: a dict argument is a side channel between blocks
    (Gemma 4's shared keys and values) whose entries may be per-rank shards."""
    if isinstance(value, torch.Tensor):
        return [] if isinstance(value, DTensor) or value.numel() == 0 else [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def probe_value(values: Any, like: torch.Tensor) -> torch.Tensor:
    """A scalar that depends on every element of every tensor in ``values`` (tuples and lists followed): each
    squashed by ``tanh`` (masks of ``-inf`` stay finite), then a fixed weighted mean of it and of its magnitude,
    summed, times :data:`PROBE_SCALE`; zeros give 0, a permutation changes it. In ``like``'s dtype and device.

    Example:
        >>> h = torch.zeros(2, 3)
        >>> float(probe_value((torch.zeros(4),), h)), float(probe_value((torch.ones(4),), h)) > 0
        (0.0, True)
    """
    total = torch.zeros((), dtype=torch.float32, device=like.device)
    for k, t in enumerate(_tensors(values)):
        x = torch.tanh(t.to(device=like.device, dtype=torch.float32)).flatten()  # (n,)
        w = torch.cos(torch.arange(x.numel(), device=like.device, dtype=torch.float32) * (math.pi / 7) + k)  # (n,)
        total = total + (x * w).mean() + (x.abs() * (1.0 + w)).mean()
    return (PROBE_SCALE * total).to(like.dtype)


class StandIn(nn.Module):
    """A block the reduced copy does not keep, at its own position: no parameters, the block's plain attributes
    (``block_type``, ``attention_type``, ``layer_idx``: what the model's loop may read), and a forward that
    returns the hidden state plus :func:`probe_value` of every other argument.

    Example:
        >>> s = StandIn(HiddenArg(position=0, tuple_out=2), {"block_type": "mamba"})
        >>> out = s(torch.zeros(1, 2, 4), torch.ones(1, 2))
        >>> out[0].shape, out[1], s.block_type
        (torch.Size([1, 2, 4]), None, 'mamba')
    """

    fourd_stand_in = True

    def __init__(self, hidden: HiddenArg, attrs: Mapping[str, Any], shadow: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.hidden_arg = hidden
        # The block it stands for, on the meta device and not registered (no parameters, no memory): what a
        # user's hook reads or sets on a block (``block.attention.n_heads //= tp`` in ``fourd_tp_plan``) lands there.
        self.__dict__["_fourd_shadow"] = shadow
        for key, value in attrs.items():
            if key != "training" and not key.startswith("_") and not hasattr(self, key):
                setattr(self, key, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadow = self.__dict__.get("_fourd_shadow")
            if shadow is None or name.startswith("__"):
                raise
            return getattr(shadow, name)

    def reset_parameters(self) -> None:
        """Nothing to initialise: a model's initialiser that walks its blocks (``layer.reset_parameters()``) runs."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        h = self.hidden_arg.get(args, kwargs)  # (B, T, H) (this rank's sequence shard under SP)
        rest = self.hidden_arg.replace(args, kwargs, None)
        return self.hidden_arg.wrap(h + probe_value(rest, h))


def stand_in_blocks(model: nn.Module, blocks_path: str, keep: set[str], hidden: HiddenArg,
                    attrs: Mapping[str, Mapping[str, Any]]) -> None:
    """Replace, in place, every block of ``model``'s container at ``blocks_path`` whose key is not in ``keep`` by a
    :class:`StandIn` (``attrs``: each block's plain attributes, by key), keeping every position.

    Example:
        >>> net = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> stand_in_blocks(net, "0", {"1"}, HiddenArg(), {"0": {"kind": "a"}})
        >>> net[0][0].kind, type(net[0][1]).__name__
        ('a', 'Linear')
    """
    container = registered_submodule(model, blocks_path)
    assert container is not None
    for key in list(child_modules(container)):
        if key not in keep:
            block = getattr(container, key)
            shadow = block if all(t.is_meta for t in [*block.parameters(), *block.buffers()]) else None
            setattr(container, key, StandIn(hidden, attrs.get(key, {}), shadow))


def plan_for_kept(plan: LayoutPlan, keep: Sequence[str]) -> LayoutPlan:
    """``plan`` for a reduced copy whose blocks ``keep`` are real and the others :class:`StandIn`\\s: the block order,
    the stages and the sequence-parallel boundary (the container's first and last entries) unchanged; the rewrite
    entries (tensor-parallel styles, experts) of the stood-in blocks dropped.

    Example:
        >>> plan = LayoutPlan(degrees=(), blocks_path="l", block_order=("0", "1", "2"), stages=(("0",), ("1", "2")))
        >>> reduced = plan_for_kept(plan, ["0", "2"])
        >>> reduced.block_order, reduced.stages
        (('0', '1', '2'), (('0',), ('1', '2')))
    """
    if set(keep) >= set(plan.block_order):
        return plan
    kept = [k for k in plan.block_order if k in set(keep)]
    filtered = plan.for_blocks(kept, {k: k for k in kept}, [list(range(len(kept)))] if plan.stages else [])
    tpl = filtered.tensor_parallel
    if tpl is not None and plan.tensor_parallel is not None:
        tpl = dataclasses.replace(tpl, boundary=plan.tensor_parallel.boundary)
    return filtered.replace(block_order=plan.block_order, stages=plan.stages, block_attrs=plan.block_attrs,
                            tensor_parallel=tpl)


def check_passes(outside_bytes: float, block_bytes: Mapping[str, float], kept: Sequence[str],
                 budget_bytes: Optional[float], copy_factor: float = 2.0) -> Optional[list[list[str]]]:
    """The kept blocks grouped into the passes of the value check: one pass with all of them when the copy (the
    modules outside the blocks and the kept blocks, ``copy_factor`` times: the unsharded copy and its rewrite)
    fits ``budget_bytes`` (``None``: no limit), else one pass per block; ``None`` when one block alone does not fit.

    Example:
        >>> check_passes(10.0, {"0": 20.0, "1": 20.0}, ["0", "1"], budget_bytes=100.0)
        [['0', '1']]
        >>> check_passes(10.0, {"0": 20.0, "1": 20.0}, ["0", "1"], budget_bytes=60.0)
        [['0'], ['1']]
        >>> check_passes(10.0, {"0": 20.0, "1": 20.0}, ["0", "1"], budget_bytes=50.0) is None
        True
    """
    need = copy_factor * (outside_bytes + sum(block_bytes[k] for k in kept))
    if budget_bytes is None or need <= budget_bytes or len(kept) <= 1:
        return [list(kept)] if budget_bytes is None or need <= budget_bytes else None
    if copy_factor * (outside_bytes + max(block_bytes[k] for k in kept)) > budget_bytes:
        return None
    return [[k] for k in kept]
