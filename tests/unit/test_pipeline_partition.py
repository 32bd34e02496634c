"""Stage partitioning and stage ↔ rank placement (pure)."""

from __future__ import annotations

import pytest

from lightning_4d.pipeline.partition import partition_blocks, partition_costs, stage_ids_for_rank, stage_to_rank


@pytest.mark.parametrize("blocks,stages", [(8, 4), (10, 4), (7, 3), (5, 5), (32, 8), (3, 1)])
def test_balanced_contiguous_cover(blocks: int, stages: int) -> None:
    parts = partition_blocks(blocks, stages)
    assert [i for p in parts for i in p] == list(range(blocks))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # extra blocks go to earlier stages


def test_embed_and_head_weights_balance_costs() -> None:
    parts = partition_blocks(10, 4, embed_weight=1.0, head_weight=2.0)
    assert [len(p) for p in parts] == [3, 3, 3, 1]
    assert max(partition_costs(parts, embed_weight=1.0, head_weight=2.0)) == 4.0
    # The balancer is optimal: no other split of 10 blocks into 4 non-empty runs has a lower maximum.
    best = min(
        max(a + 1.0, b, c, 10 - a - b - c + 2.0)
        for a in range(1, 8) for b in range(1, 8) for c in range(1, 8) if a + b + c <= 9
    )
    assert best == 4.0


def test_explicit_counts() -> None:
    assert partition_blocks(6, 3, layers_per_stage=[1, 3, 2]) == [[0], [1, 2, 3], [4, 5]]
    assert partition_blocks(4, 3, layers_per_stage=[0, 4, 0]) == [[], [0, 1, 2, 3], []]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_blocks=2, num_stages=4), "num_stages=4 is more than the 2 blocks"),
        (dict(num_blocks=4, num_stages=2, layers_per_stage=[1, 2]), "sums to 3 but the model has 4"),
        (dict(num_blocks=4, num_stages=3, layers_per_stage=[2, 2]), "has 2 entries but there are 3 stages"),
        (dict(num_blocks=4, num_stages=3, layers_per_stage=[2, 0, 2]), "middle stage would hold nothing"),
        (dict(num_blocks=4, num_stages=2, layers_per_stage=[5, -1]), "non-negative integer"),
        (dict(num_blocks=0, num_stages=2), "num_blocks=0 must be a positive integer"),
        (dict(num_blocks=4, num_stages=2, embed_weight=-1), "embed_weight=-1 must be a number >= 0"),
    ],
)
def test_partition_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition_blocks(**kwargs)


def test_loop_and_v_placement_match_torch() -> None:
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping  # reference only

    for pp in (1, 2, 3, 4):
        for v in (1, 2, 3):
            for style in ("loop", "v"):
                ref = generate_stage_to_rank_mapping(pp, pp * v, style=style)
                assert {s: stage_to_rank(s, pp, style) for s in range(pp * v)} == ref
                held = sorted(s for r in range(pp) for s in stage_ids_for_rank(r, pp, v, style))
                assert held == list(range(pp * v))
    assert stage_ids_for_rank(0, 4, 2, "loop") == [0, 4]
    assert stage_ids_for_rank(3, 4, 2, "v") == [3, 4]


def test_placement_errors() -> None:
    with pytest.raises(ValueError, match="pp_rank=4 must be an integer in"):
        stage_ids_for_rank(4, 4)
    with pytest.raises(ValueError, match="style='zigzag' is not a stage placement"):
        stage_ids_for_rank(0, 2, 2, "zigzag")  # type: ignore[arg-type]
