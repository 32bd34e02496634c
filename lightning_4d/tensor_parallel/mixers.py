r"""State-space and short-convolution mixers under tensor parallelism (pure planning: no process group).

A Mamba-2 mixer (transformers' ``Mamba2Mixer``, and the hybrids built on it) is a region like an attention: one
fused input projection read by every rank, the whole sequence of its channels, one row-parallel output projection.
What differs is found from the traced forward (:class:`~lightning_4d.analysis.trace.ColumnLayout`):

- the fused ``in_proj`` (``z | x | B | C | dt``) is cut by the sizes the forward splits it into, *through* the
  depthwise convolution (``x | B | C`` is convolved channel by channel, then split): ``x`` is viewed per head, ``B``
  / ``C`` per group (sharded with the groups when they divide by ``tp``, else each rank computes the group its heads
  use, as for a KV head fewer than ``tp``), ``z`` and ``dt`` follow the heads one feature at a time;
- the depthwise convolution (``groups == channels``) keeps the rows of the channels this rank's projection computes
  (:func:`conv_rows`; read whole, its gradient summed over ``tp``), whether the model calls the module or reads
  ``conv1d.weight`` itself;
- per-head parameters (``A_log``, ``dt_bias``, ``D``) follow the heads (the region's per-head rule);
- a (gated) norm over the inner width: per group on each rank when its groups divide by ``tp``, a distributed norm
  (statistics all-reduced) when it has one group, refused otherwise;
- the head and group counts and the cut widths the forward reads (``num_heads``, ``n_groups``, ``conv_dim``) become
  per-rank values. The scan runs unchanged on each rank's heads.

Example:
    >>> conv_rows([list(range(0, 4)) + [8, 9], list(range(4, 8)) + [8, 9]], 0, 10)
    [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7, 8, 9]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.analysis.layer_kinds import is_norm

if TYPE_CHECKING:
    from lightning_4d.analysis.trace import ModelTrace

# ``plan`` imports this module: its ``BlockPlan`` and ``Piece`` are named here by what is read of them.
BlockPlan = Any  # lightning_4d.tensor_parallel.plan.BlockPlan
Piece = Any  # lightning_4d.tensor_parallel.plan.Piece: .start, .stop, .size, .unit, .heads, .sharded

__all__ = ["GROUP_COUNT_ATTRS", "MixerPlan", "conv_rows", "linear_rows", "plan_mixer"]

# Group counts of a state-space mixer's B / C (heads of its fused projection that several value heads share): per
# rank like a KV head count (1 where each rank computes the one group its heads use).
GROUP_COUNT_ATTRS = ("n_groups", "ngroups", "num_groups", "mamba_n_groups")

_HOOK = f"{hook_call(TP_PLAN)} on your FourDModule (returns {{module path: ParallelStyle}})"


@dataclass
class MixerPlan:
    """What :func:`plan_mixer` decided for one region (paths relative to the block).

    Example:
        >>> MixerPlan().handled
        set()
    """

    handled: set[str] = field(default_factory=set)  # modules of the region planned here (not per-head rules)
    rows: dict[str, list[list[int]]] = field(default_factory=dict)  # parameter -> its rows per rank


def linear_rows(width: int, tp: int, gathered: Optional[list[list[int]]] = None,
                permutation: Optional[list[int]] = None) -> list[list[int]]:
    """The output features of a column-parallel linear each rank computes, in the order of its local output: a
    replicated-heads linear's ``gathered`` rows, a permuted fused one's contiguous shard of ``permutation``, else
    the contiguous shard.

    Example:
        >>> linear_rows(4, 2), linear_rows(4, 2, permutation=[0, 2, 1, 3])
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    if gathered is not None:
        return [list(r) for r in gathered]
    order = permutation if permutation is not None else list(range(width))
    chunk = width // tp
    return [order[r * chunk:(r + 1) * chunk] for r in range(tp)]


def conv_rows(rows: list[list[int]], start: int, stop: int) -> list[list[int]]:
    """Per rank, the channels of a depthwise convolution fed by features ``start:stop`` of a linear whose rank
    rows are ``rows``: that rank's features in the range, shifted to the convolution's channel numbers.

    Example:
        >>> conv_rows([[0, 1, 4], [2, 3, 4]], 2, 5)
        [[2], [0, 1, 2]]
    """
    return [[f - start for f in r if start <= f < stop] for r in rows]


def _depthwise_convs(region: nn.Module) -> dict[str, nn.Module]:
    """The region's depthwise 1-D convolutions (``groups`` equal to the channels), by path inside it."""
    return {n: m for n, m in region.named_modules()
            if n and isinstance(m, nn.Conv1d) and m.groups == m.in_channels == m.out_channels and m.groups > 1}


def plan_mixer(block_name: str, block: nn.Module, region: str, plan: BlockPlan,
               pieces_of: dict[str, list[Piece]], trace: Optional["ModelTrace"], tp: int) -> MixerPlan:
    """Plan the convolution, norms and per-rank sizes of one region whose projection feeds a depthwise convolution
    (nothing for any other region); records into ``plan`` (``local_attrs``, ``head_params``, ``dist_norms``,
    ``partial_params``) and returns what it handled. Raises naming the module when no exact layout exists.

    Example:
        >>> plan_mixer("h.0", nn.Linear(2, 2), "", None, {}, None, 2).rows  # type: ignore[arg-type]
        {}
    """
    out = MixerPlan()
    if trace is None:
        return out
    module = block.get_submodule(region)
    prefix = f"{region}." if region else ""
    # (linear, channels of its convolution, per rank the linear's features each channel holds, pieces inside)
    convolved: list[tuple[str, int, list[list[int]], list[_Width]]] = []
    joins: set[tuple[tuple[str, int, int], ...]] = set()
    for name, kind in plan.linears.items():
        layout = trace.columns.get(name)
        if kind != "colwise" or not name.startswith(prefix) or layout is None:
            continue
        pieces = pieces_of[name]
        rows = linear_rows(sum(p.size for p in pieces), tp, plan.gathered.get(name), plan.permutations.get(name))
        for buffer, (lo, hi) in layout.scales.items():
            if buffer.startswith(prefix):  # a per-feature scale of the output: cut with the features
                out.rows[buffer[len(prefix):]] = conv_rows(rows, lo, hi)
        for param, (lo, hi) in layout.feature_params.items():
            if param.startswith(prefix):  # a per-feature bias / scale parameter (``dt_bias``): cut with the features
                out.rows[param[len(prefix):]] = conv_rows(rows, lo, hi)
                plan.partial_params.append(param)
                out.handled.add(param)
        for lo, hi in sorted(layout.depthwise):
            inside = [_Width(p.size, p.size // tp if p.sharded else (p.unit or p.size),
                             p.heads if p.unit else None, p.sharded) for p in pieces if lo <= p.start and p.stop <= hi]
            convolved.append((name, hi - lo, conv_rows(rows, lo, hi), inside))
        for sizes in sorted(layout.depthwise_parts):
            convolved.append((name, sum(sizes), _part_rows(block_name, name, pieces, sizes, plan, tp),
                              [_Width(s, s // tp, None, True) for s in sizes]))
        joins |= layout.depthwise_joined
    for members in sorted(joins):
        convolved.append(_joined(block_name, members, plan, pieces_of, tp))
    if not convolved:
        return out
    convs = _depthwise_convs(module)
    inner = {int(m.weight.shape[1]) for n, m in module.named_modules()
             if plan.linears.get(f"{prefix}{n}") == "rowwise"}  # the sharded inner width (the row-parallel input)
    for name, width, channels, inside in convolved:
        matching = [c for c, m in convs.items() if m.in_channels == width]
        if len(matching) != 1:
            raise ValueError(
                f"{block_name}.{name}: {width} of its features go through a depthwise convolution along the sequence, "
                f"but {len(matching)} depthwise Conv1d modules of {block_name}.{region or '(the block)'} have "
                f"{width} channels ({', '.join(sorted(convs)) or 'none'}), so which one to cut with the features is "
                f"unknown. Implement {_HOOK}, or use tp=1."
            )
        conv = matching[0]
        out.handled.add(f"{prefix}{conv}")
        for pname, _ in convs[conv].named_parameters(recurse=False):
            out.rows[f"{conv}.{pname}"] = channels
            plan.partial_params.append(f"{prefix}{conv}.{pname}")
        _mixer_attrs(module, region, plan, width, len(channels[0]), inside, tp)
        _plan_norms(block_name, module, region, plan, inner, {name}, tp, out)
    return out


def _joined(block_name: str, members: tuple[tuple[str, int, int], ...], plan: BlockPlan,
            pieces_of: dict[str, list[Piece]], tp: int) -> tuple[str, int, list[list[int]], list["_Width"]]:
    """A depthwise convolution over ``cat`` of ranges of several column-parallel linears (Kimi-Linear's
    ``q_proj | k_proj | v_proj``): per rank, each member's features in its range, shifted to where the range sits in
    the concatenation. Returns what :func:`plan_mixer` convolves: (first member, channels, rows per rank, pieces)."""
    channels: list[list[int]] = [[] for _ in range(tp)]
    inside: list[_Width] = []
    offset = 0
    for name, lo, hi in members:
        if plan.linears.get(name) != "colwise" or name not in pieces_of:
            raise ValueError(
                f"{block_name}.{name}: its output features {lo}:{hi} are concatenated with those of "
                f"{', '.join(m[0] for m in members if m[0] != name)} and convolved channel by channel, but it is not "
                f"column-parallel ({plan.linears.get(name, 'not planned')}), so the convolution's channels cannot "
                f"follow every member over the ranks. Fix: use tp=1 for this model, or implement {_HOOK}."
            )
        pieces = pieces_of[name]
        rows = linear_rows(sum(p.size for p in pieces), tp, plan.gathered.get(name), plan.permutations.get(name))
        for r, part in enumerate(conv_rows(rows, lo, hi)):
            channels[r] += [offset + f for f in part]
        inside += [_Width(p.size, p.size // tp if p.sharded else (p.unit or p.size), p.heads if p.unit else None,
                          p.sharded) for p in pieces if lo <= p.start and p.stop <= hi]
        offset += hi - lo
    if len({len(c) for c in channels}) != 1:
        raise ValueError(
            f"{block_name}: a depthwise convolution over cat({', '.join(m[0] for m in members)}) would hold "
            f"{[len(c) for c in channels]} channels on the {tp} ranks: its members do not split evenly. Fix: use a tp "
            f"that divides every member's heads, or implement {_HOOK}."
        )
    return members[0][0], offset, channels, inside


@dataclass(frozen=True)
class _Width:
    """A piece of a convolved range: its width, its width on one rank, its heads (``None``: not viewed in heads) and
    whether those are split over the ranks."""

    size: int
    local: int
    heads: Optional[int]
    sharded: bool


def _part_rows(block_name: str, name: str, pieces: list[Piece], sizes: tuple[int, ...], plan: BlockPlan,
               tp: int) -> list[list[int]]:
    """Per rank, the channels of a convolution over ``cat(parts)`` of pieces cut inside the groups of linear
    ``name`` (Qwen3-Next's ``q | k | v``, each flattened group by group): with the linear split by whole groups,
    each rank holds a contiguous share of every part.

    Example:
        >>> from lightning_4d.tensor_parallel.plan import BlockPlan, Piece
        >>> _part_rows("h.0", "in_proj", [Piece(0, 12, 6)], (4, 2), BlockPlan(), 2)
        [[0, 1, 4], [2, 3, 5]]
    """
    grouped = len(pieces) == 1 and pieces[0].unit is not None and pieces[0].sharded
    if not grouped or name in plan.gathered or name in plan.permutations or any(s % tp for s in sizes):
        raise ValueError(
            f"{block_name}.{name}: a depthwise convolution runs over a concatenation of pieces ({list(sizes)} "
            f"features) cut from its output, which tensor parallelism cannot follow unless the projection is viewed "
            f"in groups (heads) that split evenly over tp={tp} and every piece divides by tp. Fix: use a tp that "
            f"divides its number of groups and the pieces, or implement {_HOOK}."
        )
    out: list[list[int]] = [[] for _ in range(tp)]
    start = 0
    for size in sizes:
        for r in range(tp):
            out[r] += list(range(start + r * size // tp, start + (r + 1) * size // tp))
        start += size
    return out


def _mixer_attrs(module: nn.Module, region: str, plan: BlockPlan, width: int, local_width: int,
                 inside: list[_Width], tp: int) -> None:
    """Per-rank values of what a mixer's forward cuts and views its convolved channels by: the convolved width
    (``conv_dim``), a piece's width (Falcon-H1's ``groups_time_state_size``, Qwen3-Next's ``key_dim``) and the group
    count of B / C (``n_groups``: 1 where each rank computes its heads' group)."""
    local: dict[str, int] = dict(plan.local_attrs.get(region, {}))
    found: dict[str, int] = dict(plan.head_attrs.get(region, {}))
    for attr, value in vars(module).items():
        if isinstance(value, bool) or not isinstance(value, int) or attr in local:
            continue
        sizes = {local_width} if value == width else {p.local for p in inside if p.size == value}
        if len(sizes) == 1 and sizes != {value}:
            found[attr], local[attr] = value, sizes.pop()
    for attr in GROUP_COUNT_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, bool) or not isinstance(value, int) or attr in local:
            continue
        counts = {1 if not p.sharded else value // tp for p in inside if p.heads == value}
        if len(counts) == 1:
            found[attr], local[attr] = value, counts.pop()
    if local:
        plan.local_attrs[region], plan.head_attrs[region] = local, found


def _plan_norms(block_name: str, module: nn.Module, region: str, plan: BlockPlan, inner: set[int],
                sources: set[str], tp: int, out: MixerPlan) -> None:
    """A norm of a mixer region over its whole sharded inner width (Mamba-2's gated ``norm`` before ``out_proj``):
    per group on each rank's features when its groups (``group_size``) divide by ``tp``, a distributed norm when it
    is one group, refused otherwise."""
    prefix = f"{region}." if region else ""
    for sub_name, sub in module.named_modules():
        path = f"{prefix}{sub_name}"
        if not sub_name or not is_norm(sub) or path in out.handled:
            continue
        weight = getattr(sub, "weight", None)
        size = int(weight.shape[-1]) if weight is not None and weight.dim() == 1 else None
        if size not in inner:
            continue
        count = getattr(sub, "n_groups", None)  # Falcon-H1's norm counts its groups, Mamba-2's sizes them
        group = getattr(sub, "group_size", size // count if isinstance(count, int) and count > 0 else size)
        groups = size // group if isinstance(group, int) and group > 0 and size % group == 0 else None
        if groups is not None and groups % tp == 0:
            for pname, p in sub.named_parameters(recurse=False):
                plan.head_params[f"{path}.{pname}"] = [(r * size // tp, (r + 1) * size // tp) for r in range(tp)]
                plan.partial_params.append(f"{path}.{pname}")
            if isinstance(count, int) and not isinstance(count, bool) and groups > 1:
                plan.head_attrs[path], plan.local_attrs[path] = {"n_groups": count}, {"n_groups": count // tp}
        elif groups == 1:
            plan.dist_norms[path] = sorted(sources)[0]
        else:
            raise ValueError(
                f"{block_name}.{path} normalises the mixer's inner width ({size} features) in {groups or 'unknown'} "
                f"groups of {group}, which neither divide by tp={tp} (each rank normalising its own groups) nor form "
                f"one group (a distributed norm), so a group would straddle ranks. Fix: use a tp that divides the "
                f"number of groups, or implement {_HOOK}."
            )
        out.handled.add(path)
