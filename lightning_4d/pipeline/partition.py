"""Stage partitioning and stage ↔ rank placement (pure: no process group, no torch needed).

A model's repeated blocks (``layers.0 … layers.{n-1}``) are cut into contiguous runs, one per
pipeline stage. Stage 0 also runs the modules registered before the blocks (token embedding) and
the last stage the modules after them (final norm, output head); ``embed_weight`` / ``head_weight``
let the balancer count those as a fraction of a block.

Placement of stages on ranks follows ``torch.distributed.pipelining``:

- ``"loop"`` (GPipe, 1F1B, interleaved 1F1B): rank ``r`` holds stages ``r, r + pp, r + 2·pp, …``.
- ``"v"`` (ZBV zero-bubble, DualPipeV): the stages zig-zag, so with two stages per rank, rank ``r``
  holds ``r`` and ``2·pp − 1 − r`` (the first and the last stage share rank 0).

Example:
    >>> partition_blocks(8, 4)
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> stage_ids_for_rank(1, 4, 2, "v")
    [1, 6]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Optional

from lightning_4d.analysis.hooks import PipelineSplit

__all__ = ["PipelineSplit", "StageStyle", "partition_blocks", "stage_ids_for_rank", "stage_to_rank", "partition_costs"]

StageStyle = Literal["loop", "v"]


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; pass e.g. {name}=2.")
    return value


def _check_weight(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"{name}={value!r} must be a number >= 0 (the cost of that module in units of one block); "
            f"pass e.g. {name}=1.0 or leave it at 0."
        )
    return float(value)


def partition_blocks(
    num_blocks: int,
    num_stages: int,
    *,
    layers_per_stage: Optional[Sequence[int]] = None,
    embed_weight: float = 0.0,
    head_weight: float = 0.0,
) -> list[list[int]]:
    """Split ``num_blocks`` uniform blocks into ``num_stages`` contiguous runs.

    Balanced by default: the maximum stage cost is minimised, where a stage costs its number of
    blocks, plus ``embed_weight`` on stage 0 and ``head_weight`` on the last stage (both in units of
    one block). Ties give the extra block to the earlier stage. Every stage gets at least one block.

    Args:
        num_blocks: number of repeated blocks (e.g. transformer layers).
        num_stages: total pipeline stages (``pp · virtual_stages``).
        layers_per_stage: explicit block counts per stage (validated: ``num_stages`` non-negative
            integers summing to ``num_blocks``; only the first/last stage may be empty, since they
            still hold the embedding/head).
        embed_weight: cost of the modules before the blocks, in blocks.
        head_weight: cost of the modules after the blocks, in blocks.

    Returns:
        ``num_stages`` lists of block indices, in stage order.

    Raises:
        ValueError: more stages than blocks, bad counts or weights.

    Example:
        >>> partition_blocks(10, 4)
        [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
        >>> partition_blocks(5, 3, embed_weight=1.0)
        [[0], [1, 2], [3, 4]]
        >>> partition_blocks(4, 2, layers_per_stage=[1, 3])
        [[0], [1, 2, 3]]
    """
    _check_positive_int("num_blocks", num_blocks)
    _check_positive_int("num_stages", num_stages)
    embed_weight = _check_weight("embed_weight", embed_weight)
    head_weight = _check_weight("head_weight", head_weight)

    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ValueError(
                f"layers_per_stage={counts} has {len(counts)} entries but there are {num_stages} stages. "
                f"Give one block count per stage (pp · virtual_stages entries)."
            )
        for i, c in enumerate(counts):
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise ValueError(f"layers_per_stage[{i}]={c!r} must be a non-negative integer.")
            if c == 0 and 0 < i < num_stages - 1:
                raise ValueError(
                    f"layers_per_stage[{i}]=0: a middle stage would hold nothing. Only the first and last "
                    f"stages may have zero blocks (they still run the embedding / head); move a block there."
                )
        if sum(counts) != num_blocks:
            raise ValueError(
                f"layers_per_stage={counts} sums to {sum(counts)} but the model has {num_blocks} blocks. "
                f"The counts must add up to the number of blocks."
            )
    else:
        if num_stages > num_blocks:
            raise ValueError(
                f"num_stages={num_stages} is more than the {num_blocks} blocks of the model: every pipeline stage "
                f"needs at least one block. Use pp · virtual_stages <= {num_blocks} (fewer virtual stages or a "
                f"smaller pp) or a model with more blocks."
            )
        extra = [0.0] * num_stages
        extra[0] += embed_weight
        extra[-1] += head_weight
        counts = [1] * num_stages
        # Uniform items: giving each next block to the currently cheapest stage minimises the maximum.
        for _ in range(num_blocks - num_stages):
            costs = [counts[s] + extra[s] for s in range(num_stages)]
            best = min(range(num_stages), key=lambda s: (costs[s], s))
            counts[best] += 1

    out: list[list[int]] = []
    start = 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def partition_costs(
    parts: Sequence[Sequence[int]], *, embed_weight: float = 0.0, head_weight: float = 0.0
) -> list[float]:
    """Cost of each stage of a partition, in blocks (embedding / head weights included).

    Example:
        >>> partition_costs(partition_blocks(5, 3, embed_weight=1.0), embed_weight=1.0)
        [2.0, 2.0, 2.0]
    """
    costs = [float(len(p)) for p in parts]
    if costs:
        costs[0] += embed_weight
        costs[-1] += head_weight
    return costs


def _check_style(style: str) -> None:
    if style not in ("loop", "v"):
        raise ValueError(
            f"style={style!r} is not a stage placement. Use 'loop' (GPipe, 1F1B, interleaved) or 'v' (ZBV, DualPipeV)."
        )


def stage_to_rank(stage: int, pp: int, style: StageStyle = "loop") -> int:
    """The pp rank that holds global stage ``stage``.

    Example:
        >>> [stage_to_rank(s, 2, "v") for s in range(4)]
        [0, 1, 1, 0]
    """
    _check_positive_int("pp", pp)
    _check_style(style)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise ValueError(f"stage={stage!r} must be a non-negative integer.")
    chunk, pos = divmod(stage, pp)
    if style == "loop" or chunk % 2 == 0:
        return pos
    return pp - 1 - pos


def stage_ids_for_rank(pp_rank: int, pp: int, virtual_stages: int = 1, style: StageStyle = "loop") -> list[int]:
    """Global stage indices held by ``pp_rank`` (ascending), matching torch's stage ↔ rank mapping.

    Args:
        pp_rank: this rank's coordinate on the ``pp`` mesh axis.
        pp: pipeline-parallel degree.
        virtual_stages: stages per rank.
        style: ``"loop"`` or ``"v"`` (see the module docstring).

    Example:
        >>> stage_ids_for_rank(1, 4, 2, "loop")
        [1, 5]
        >>> stage_ids_for_rank(0, 4, 2, "v")
        [0, 7]
    """
    _check_positive_int("pp", pp)
    _check_positive_int("virtual_stages", virtual_stages)
    _check_style(style)
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank!r} must be an integer in [0, {pp}).")
    stages = [s for s in range(pp * virtual_stages) if stage_to_rank(s, pp, style) == pp_rank]
    return stages
