"""Pure validation of degrees, options and rank coordinates (no process group)."""

from __future__ import annotations

import pytest

from lightning_4d import FourDConfig, FourDStrategy, ParallelDims
from lightning_4d.mesh import rank_coordinates


def test_dp_is_inferred() -> None:
    dims = ParallelDims.from_world(16, tp=2, pp=2, ep=4)
    assert (dims.dp, dims.edp, dims.num_stages) == (4, 2, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=8, tp=3), r"world size 8 is not divisible by tp·pp = 3·1 = 3, so dp cannot be inferred"),
        (dict(world_size=8, tp=2, dp=3), r"tp·pp·dp = 2·1·3 = 6 does not equal the world size 8"),
        (dict(world_size=8, tp=0), r"tp=0 is below 1"),
        (dict(world_size=8, tp=2.0), r"tp=2.0 is not an integer"),
        (dict(world_size=8, tp=True), r"tp=True is not an integer"),
        (dict(world_size=8, ep=3), r"ep=3 does not divide dp·tp = 8·1 = 8.*\[1, 2, 4, 8\]"),
        (dict(world_size=8, tp=2, ep=2, sequence_parallel=False), r"ep=2 with tp=2 needs sequence_parallel=True.*Set sequence_parallel=True"),
        (dict(world_size=8, virtual_stages=2), r"virtual_stages=2 needs pp > 1.*Set pp >= 2 or virtual_stages=1"),
        (dict(world_size=8, dp="two"), r"dp='two' is not understood"),
        (dict(world_size=0), r"world_size=0 is below 1"),
    ],
)
def test_invalid_degrees(kwargs: dict, match: str) -> None:
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_world(world, **kwargs)


def test_rank_order_tp_innermost_pp_outermost() -> None:
    dims = ParallelDims.from_world(8, tp=2, pp=2, ep=4)
    coords = [rank_coordinates(dims, r) for r in range(8)]
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["pp"] for c in coords] == [0] * 4 + [1] * 4
    assert [c["dp"] for c in coords] == [0, 0, 1, 1] * 2
    # Experts fold over the dp×tp ranks of a stage, ep innermost.
    assert [c["ep"] for c in coords] == [0, 1, 2, 3] * 2
    with pytest.raises(ValueError, match="outside the world"):
        rank_coordinates(dims, 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule="bogus"), r"schedule='bogus' is not known\. Choose one of gpipe, 1f1b"),
        (dict(data_parallel="ddp"), r"data_parallel='ddp' is not supported\. Use 'fsdp'"),
        (dict(activation_checkpointing="some"), r"activation_checkpointing='some' is not supported\. Use None, 'selective' or 'full'"),
        (dict(schedule="interleaved_1f1b", pp=2, virtual_stages=1), r"schedule='interleaved_1f1b' runs several stages per rank, but virtual_stages=1"),
        (dict(schedule="zbv", pp=2, virtual_stages=3), r"schedule='zbv' places exactly 2 stages per rank.*virtual_stages=3"),
        (dict(schedule="1f1b", pp=2, virtual_stages=2), r"schedule='1f1b' runs one stage per rank, but virtual_stages=2.*'interleaved_1f1b'"),
        (dict(microbatches=0), r"microbatches=0 is below 1"),
        (dict(sequence_parallel="yes"), r"sequence_parallel='yes' must be True or False"),
    ],
)
def test_invalid_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FourDConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        FourDStrategy(**kwargs)


def test_stages_per_rank_defaults() -> None:
    assert FourDConfig(pp=2, schedule="interleaved_1f1b").stages_per_rank == 2
    assert FourDConfig(pp=2, schedule="1f1b").stages_per_rank == 1
    assert FourDConfig(schedule="zbv").stages_per_rank == 1  # pp=1: no pipeline at all


def test_strategy_registered_by_name() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert "fourd" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("fourd"), FourDStrategy)


def test_timeout_must_be_timedelta() -> None:
    with pytest.raises(ValueError, match="timeout=5 must be a datetime.timedelta"):
        FourDStrategy(timeout=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(data_parallel="hsdp"), r"data_parallel='hsdp' needs dp_shard"),
        (dict(dp_shard=2), r"dp_shard=2 only applies to data_parallel='hsdp' \(got 'fsdp'\)"),
        (dict(data_parallel="hsdp", dp_shard=0), r"dp_shard=0 is below 1"),
        (dict(data_parallel="zero3"), r"data_parallel='zero3' is not supported.*'hsdp'"),
    ],
)
def test_hsdp_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FourDConfig(**kwargs)


def test_hsdp_degrees() -> None:
    dims = FourDConfig(tp=2, data_parallel="hsdp", dp_shard=4).resolve(16)
    assert (dims.dp, dims.dp_shard, dims.dp_replicate) == (8, 4, 2)
    assert ParallelDims.from_world(8).dp_replicate == 1  # no HSDP: one replica group
    with pytest.raises(ValueError, match=r"dp_shard=3 does not divide dp=4.*among \[1, 2, 4\]"):
        FourDConfig(data_parallel="hsdp", dp_shard=3).resolve(4)


def test_mesh_backend_override_takes_device_backend_strings() -> None:
    """The sub-groups' timeout reaches ``"cuda:gloo"`` (ranks sharing a GPU) and ``"cpu:gloo"`` as it reaches
    ``"gloo"``; a string mixing two backends keeps torch's defaults (one options object cannot serve both)."""
    from datetime import timedelta

    from lightning_4d._compat import mesh_backend_override

    for backend in ("gloo", "cpu:gloo", "cuda:gloo"):
        override = mesh_backend_override(backend, timedelta(seconds=7), 3)
        assert override is not None and len(override) == 3
        assert {b for b, _ in override} == {backend} and override[0][1]._timeout == timedelta(seconds=7)
    assert mesh_backend_override("cpu:gloo,cuda:nccl", timedelta(seconds=7), 3) is None
    assert mesh_backend_override("cuda:gloo", None, 3) is None
@pytest.mark.parametrize("kwargs", [dict(tp=2, pp=2, ep=2), dict(tp=2, pp=2, ep=4, cp=1), dict(pp=2, cp=2, ep=2),
                                    dict(pp=2, dp=4, dp_shard=2, ep=2)])
def test_expert_view_shares_the_dense_mesh_groups(kwargs: dict) -> None:
    """The expert view (pp, edp, ep) is derived from the dense mesh's root: its pp groups are the dense mesh's, and
    build_mesh creates each axis's communicator once (a second DeviceMesh made the pp groups again); the axes hold
    the ranks of rank_coordinates."""
    from torch.distributed.distributed_c10d import _world

    from lightning_4d.mesh import build_mesh, rank_coordinates
    from lightning_4d.planner.fake_world import fake_world

    dims = ParallelDims.from_world(8, **kwargs)
    for rank in (0, 5):
        with fake_world(8, rank=rank):
            before = set(_world.pg_map)
            mesh = build_mesh(dims, "cpu")
            created = [pg.group_desc for pg in _world.pg_map if pg not in before]
            assert mesh["pp"].get_group() is mesh.expert["pp"].get_group()
            assert sorted(created) == sorted(set(created)), created  # no axis twice
            assert created.count("mesh_pp") == 1
            mine = rank_coordinates(dims, rank)
            for axis in ("pp", "dp", "tp", "edp", "ep", *(("cp",) if dims.cp > 1 else ())):
                view = ("pp", "edp", "ep") if axis in ("edp", "ep") else ("pp", "dp", "cp", "tp")
                fixed = [a for a in view if a != axis and a in mine]
                ranks = [r for r in range(8) if all(rank_coordinates(dims, r)[a] == mine[a] for a in fixed)]
                assert mesh[axis].mesh.tolist() == ranks, (axis, rank)


def test_a_second_build_of_a_layout_reuses_its_process_groups() -> None:
    """Several fits in one process (a sweep, a test world) reuse a layout's groups rather than opening new
    communicators each time (gloo's threads, NCCL's memory) that nothing closes; the dims are the caller's; once
    the world is destroyed, a build makes new groups."""
    from torch.distributed.distributed_c10d import _world

    from lightning_4d.mesh import build_mesh
    from lightning_4d.planner.fake_world import fake_world

    dims = ParallelDims.from_world(8, tp=2, pp=2, ep=2)
    with fake_world(8, rank=3):
        first = build_mesh(dims, "cpu")
        first_tp = first["tp"].get_group()
        before = set(_world.pg_map)
        again = build_mesh(ParallelDims.from_world(8, tp=2, pp=2, ep=2, virtual_stages=2), "cpu")
        assert set(_world.pg_map) == before  # no new group
        assert again.dims.virtual_stages == 2 and first.dims.virtual_stages == 1
        for axis in ("pp", "dp", "tp", "edp", "ep"):
            assert again[axis].get_group() is first[axis].get_group(), axis
        other = build_mesh(ParallelDims.from_world(8, tp=4, pp=2), "cpu")  # another layout: its own groups
        assert other["tp"].size() == 4 and set(_world.pg_map) > before
    with fake_world(8, rank=3):
        fresh = build_mesh(dims, "cpu")
        assert fresh is not first and fresh["tp"].get_group() in _world.pg_map
        assert fresh["tp"].get_group() is not first_tp
