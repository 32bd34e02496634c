"""Tensor-parallel styles as plan data: every style the planner or a user's ``fourd_tp_plan`` produces is read
back into a :class:`StyleSpec`, survives JSON, and builds an object equal (attribute by attribute) to the
original; the reduced-copy plan keeps its sequence boundary on the kept blocks."""

from __future__ import annotations

import json

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_4d.plan import LayoutPlan
from lightning_4d.tensor_parallel.apply import TPLayout
from lightning_4d.tensor_parallel.specs import StyleSpec, spec_of
from lightning_4d.tensor_parallel.styles import (
    Colwise,
    DistributedNorm,
    GatheredColumns,
    LowRankDown,
    RegionInput,
    Rowwise,
)

STYLES = [
    Colwise(), Colwise(permutation=[0, 2, 1, 3], partial_input=True, sequence=True),
    Rowwise(output_layouts=Shard(1)), Rowwise(output_layouts=Replicate(), sequence=True), LowRankDown(),
    GatheredColumns([[0, 1, 4], [2, 3, 4]]), RegionInput(sequence_parallel=True),
    RegionInput(sequence_parallel=False, rows={"conv1d.weight": [[0, 1], [2, 3]]}), DistributedNorm(),
    ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()), SequenceParallel(use_local_output=True),
    PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True),
    PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
]


@pytest.mark.parametrize("style", STYLES, ids=lambda s: type(s).__name__)
def test_every_style_round_trips_through_json(style: object) -> None:
    spec = spec_of(style)  # type: ignore[arg-type]
    back = StyleSpec.from_data(json.loads(json.dumps(spec.to_data("m"))))
    assert back == spec
    assert vars(back.build()) == vars(style)
    assert str(spec).startswith(type(style).__name__ + "(")


def test_a_style_without_a_written_form_applies_but_is_not_saved() -> None:
    class Custom(ColwiseParallel):
        pass

    spec = spec_of(Custom())
    assert spec.kind == "object" and isinstance(spec.build(), Custom)
    with pytest.raises(ValueError, match="layers.0.q: its style Custom .* has no written form"):
        spec.to_data("layers.0.q")


def test_reduced_plan_renames_blocks_and_keeps_the_sequence_boundary_on_the_kept_ones() -> None:
    tpl = TPLayout(styles={f"l.{i}.mlp.w1": StyleSpec("Colwise") for i in range(4)},
                   partial_params=["l.3.norm.weight"], boundary=("l.0", "l.3"),
                   regions={f"l.{i}": ["mlp"] for i in range(4)})
    plan = LayoutPlan(degrees=(("tp", 2),), blocks_path="l", block_order=("0", "1", "2", "3"), tensor_parallel=tpl)
    reduced = plan.for_blocks(["0", "3"], {"0": "0", "3": "1"}, [[0, 1]])
    assert reduced.block_order == ("0", "1")
    assert reduced.tensor_parallel is not None
    assert sorted(reduced.tensor_parallel.styles) == ["l.0.mlp.w1", "l.1.mlp.w1"]
    assert reduced.tensor_parallel.partial_params == ["l.1.norm.weight"]
    assert reduced.tensor_parallel.boundary == ("l.0", "l.1")
    # keeping one module whole drops its styles only
    whole = plan.without_styles("l.2.mlp")
    assert whole.tensor_parallel is not None and "l.2.mlp.w1" not in whole.tensor_parallel.styles
    assert len(whole.tensor_parallel.styles) == 3 and plan.tensor_parallel is tpl  # the original is unchanged
