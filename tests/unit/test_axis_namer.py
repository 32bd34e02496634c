"""The one namer of a collective's process group, as every recorder uses it (fake process group, one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_4d.core.comm import CommCounter, axis_of_group, mesh_axis_groups, name_axis
from lightning_4d.mesh import ParallelDims

pytestmark = pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a process group")


def test_name_axis_tie_break() -> None:
    assert name_axis(("ep", "tp"), "all_reduce") == "tp"  # dense before expert, whatever the order given
    assert name_axis(("tp", "ep"), "all_to_all") == "ep"  # an all-to-all is expert traffic
    assert name_axis(("dp", "edp"), "all_to_all") == "edp" and name_axis(("edp", "dp"), "reduce_scatter") == "dp"
    assert name_axis(("custom",)) == "custom"


def test_every_recorder_names_a_shared_group_the_same_way() -> None:
    """tp and ep both span the two ranks (torch hands both the default group): the all-reduce on it is tp traffic,
    the all-to-all ep traffic, for the fake-world recorder, the monitors' timed recorder and the base counter."""
    from lightning_4d.callbacks.communication import CommRecorder
    from lightning_4d.mesh import build_mesh
    from lightning_4d.planner.fake_world import CollectiveRecorder, fake_world

    with fake_world(2, rank=1):
        mesh = build_mesh(ParallelDims.from_world(2, tp=2, ep=2), "cpu")
        groups = mesh_axis_groups(mesh)
        shared = mesh["tp"].get_group()
        assert shared.group_name == mesh["ep"].get_group().group_name == dist.group.WORLD.group_name
        assert set(groups[shared.group_name]) == {"tp", "ep"}
        recorders = [CollectiveRecorder(mesh), CommRecorder(groups), CommCounter(groups)]
        for rec in recorders:
            with rec:
                dist.all_reduce(torch.ones(4), group=shared)
                dist.all_to_all_single(torch.empty(4), torch.ones(4), group=shared)
        names = [sorted((r.axis, r.kind) for r in rec.records) for rec in recorders]
        assert names[0] == names[1] == names[2] == [("ep", "all_to_all"), ("tp", "all_reduce")]
    assert axis_of_group(None, "all_reduce", groups) == "other"


def test_default_group_outside_the_mesh_is_world() -> None:
    from lightning_4d.mesh import build_mesh
    from lightning_4d.planner.fake_world import CollectiveRecorder, fake_world

    with fake_world(4, rank=0):
        mesh = build_mesh(ParallelDims.from_world(4, tp=2, pp=2), "cpu")  # no axis spans all 4 ranks
        with CollectiveRecorder(mesh) as rec:
            dist.all_reduce(torch.ones(4))
    assert [(r.axis, r.kind) for r in rec.records] == [("world", "all_reduce")]
