"""Parallel degrees (pure validation) and the 4D device mesh.

Rank order is ``(pp, dp, tp)`` with ``tp`` innermost (fastest varying), so a TP group stays
inside one node's fast interconnect and pipeline stages span nodes; with context parallelism (``cp > 1``) it is
``(pp, dp, cp, tp)``, and parameters are data-parallel over the flattened ``dp × cp`` ranks (``dp_cp``); under HSDP
with cp, ``dp`` is ``dp_replicate × dp_shard`` and FSDP2 shards over ``dp_shard × cp`` (TorchTitan's
``dp_shard_cp``), replicating over ``dp_replicate``.
Experts use a second view over the same ``dp × cp × tp`` ranks of one stage: ``(pp, edp, ep)``
with ``ep`` innermost ("MoE parallel folding").

Example:
    >>> dims = ParallelDims.from_world(8, tp=2, pp=2, ep=2)
    >>> dims.dp, dims.edp
    (2, 2)
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Union

if TYPE_CHECKING:
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Axis", "ParallelDims", "FourDMesh", "build_mesh", "rank_coordinates"]


class Axis(str, enum.Enum):
    """Names of the mesh axes, written once for the whole package.

    Example:
        >>> Axis.TP.value
        'tp'
    """

    PP = "pp"
    DP = "dp"
    TP = "tp"
    EDP = "edp"
    EP = "ep"
    CP = "cp"
    DP_CP = "dp_cp"


def _check_degree(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{name}={value!r} is not an integer. Parallel degrees must be positive integers; "
            f"pass e.g. {name}=2."
        )
    if value < 1:
        raise ValueError(f"{name}={value} is below 1. Parallel degrees must be >= 1; use {name}=1 to disable it.")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees of the four parallelisms. Pure: no process group is needed.

    Args:
        world_size: number of ranks in the job.
        tp: tensor-parallel degree (innermost axis).
        pp: pipeline-parallel degree (outermost axis).
        ep: expert-parallel degree, folded into the ``dp × cp × tp`` ranks of a stage.
        dp: data-parallel degree; ``world_size / (tp · pp · cp)``.
        sequence_parallel: shard norms/dropout along the sequence inside TP regions.
        virtual_stages: pipeline stages per rank (``> 1`` for interleaved / ZBV schedules).
        dp_shard: HSDP only: the data-parallel ranks that shard each parameter (FSDP2 inside a group of
            ``dp_shard`` ranks, e.g. one node, replicated over ``dp / dp_shard`` groups); ``None``: no HSDP.
        cp: context-parallel degree (between ``dp`` and ``tp``): the sequence of every sample is split over ``cp``
            ranks (:mod:`lightning_4d.context_parallel`).

    Every broken rule raises ``ValueError`` naming the value, the rule and a fix.

    Example:
        >>> ParallelDims.from_world(4, tp=2).dp
        2
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = True
    virtual_stages: int = 1
    dp_shard: Optional[int] = None
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "ep", "dp", "virtual_stages", "cp"):
            _check_degree(name, getattr(self, name))
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} must be True or False.")
        if self.tp * self.pp * self.dp * self.cp != self.world_size:
            cp = "·cp" if self.cp > 1 else ""
            raise ValueError(
                f"tp·pp·dp{cp} = {self.tp}·{self.pp}·{self.dp}{f'·{self.cp}' if cp else ''} = "
                f"{self.tp * self.pp * self.dp * self.cp} does not equal the world size {self.world_size}. The world "
                f"must be exactly tp·pp·dp{cp} ranks; leave dp='auto' or change devices/num_nodes."
            )
        if (self.dp * self.cp * self.tp) % self.ep != 0:
            folded = "dp·cp·tp" if self.cp > 1 else "dp·tp"
            values = f"{self.dp}·{self.cp}·{self.tp}" if self.cp > 1 else f"{self.dp}·{self.tp}"
            raise ValueError(
                f"ep={self.ep} does not divide {folded} = {values} = {self.dp * self.cp * self.tp}. Experts are folded "
                f"into the {folded.replace('·', '×')} ranks of a stage, so ep must divide {folded}; choose ep among "
                f"{_divisors(self.dp * self.cp * self.tp)}."
            )
        if self.ep > 1 and self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"ep={self.ep} with tp={self.tp} needs sequence_parallel=True: without it every TP rank holds the "
                f"same tokens and expert dispatch would route them tp times. Set sequence_parallel=True."
            )
        if self.dp_shard is not None:
            _check_degree("dp_shard", self.dp_shard)
            if self.dp % self.dp_shard != 0:
                raise ValueError(
                    f"dp_shard={self.dp_shard} does not divide dp={self.dp}. HSDP shards each parameter over "
                    f"dp_shard ranks and replicates over dp/dp_shard groups; choose dp_shard among "
                    f"{_divisors(self.dp)}."
                )
        if self.virtual_stages > 1 and self.pp == 1:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs pp > 1 (it is the number of pipeline stages per rank). "
                f"Set pp >= 2 or virtual_stages=1."
            )

    @classmethod
    def from_world(
        cls,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        dp: Union[int, Literal["auto"]] = "auto",
        sequence_parallel: bool = True,
        virtual_stages: int = 1,
        dp_shard: Optional[int] = None,
        cp: int = 1,
    ) -> "ParallelDims":
        """Infer ``dp = world / (tp · pp · cp)`` when ``dp="auto"`` and validate everything.

        Example:
            >>> ParallelDims.from_world(8, tp=2, pp=2).dp
            2
            >>> ParallelDims.from_world(8, tp=2, cp=2).dp
            2
        """
        _check_degree("world_size", world_size)
        _check_degree("tp", tp)
        _check_degree("pp", pp)
        _check_degree("cp", cp)
        if dp == "auto":
            if world_size % (tp * pp * cp) != 0:
                cps, cpv = ("·cp", f"·{cp}") if cp > 1 else ("", "")
                raise ValueError(
                    f"The world size {world_size} is not divisible by tp·pp{cps} = {tp}·{pp}{cpv} = {tp * pp * cp}, "
                    f"so dp cannot be inferred. Use a world that is a multiple of tp·pp{cps}, or change the degrees."
                )
            dp = world_size // (tp * pp * cp)
        elif isinstance(dp, str):
            raise ValueError(f"dp={dp!r} is not understood: pass an integer or 'auto'.")
        return cls(world_size, tp, pp, ep, dp, sequence_parallel, virtual_stages, dp_shard, cp)

    @property
    def edp(self) -> int:
        """Data-parallel degree of expert parameters: ``dp · cp · tp / ep``."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def dp_cp(self) -> int:
        """Ranks holding different tokens for the same parameters, ``dp · cp``: gradients are reduced over them."""
        return self.dp * self.cp

    @property
    def dp_replicate(self) -> int:
        """HSDP replica groups ``dp / dp_shard`` (1 without HSDP)."""
        return self.dp // self.dp_shard if self.dp_shard is not None else 1

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is active (it needs ``tp > 1``)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def num_stages(self) -> int:
        """Total number of pipeline stages ``pp · virtual_stages``."""
        return self.pp * self.virtual_stages


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def rank_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Coordinates of a global rank on every axis (pure).

    Example:
        >>> rank_coordinates(ParallelDims.from_world(8, tp=2, pp=2), 5)
        {'pp': 1, 'dp': 0, 'tp': 1, 'edp': 1, 'ep': 0}
        >>> rank_coordinates(ParallelDims.from_world(8, tp=2, cp=2), 6)  # "cp" only when cp > 1
        {'pp': 0, 'dp': 1, 'tp': 0, 'edp': 6, 'ep': 0, 'cp': 1}
    """
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank={rank} is outside the world of {dims.world_size} ranks.")
    pp, rest = divmod(rank, dims.dp * dims.cp * dims.tp)
    dp_cp, tp = divmod(rest, dims.tp)
    dp, cp = divmod(dp_cp, dims.cp)
    edp, ep = divmod(rest, dims.ep)
    coords = {"pp": pp, "dp": dp, "tp": tp, "edp": edp, "ep": ep}
    return {**coords, "cp": cp} if dims.cp > 1 else coords


@dataclass
class FourDMesh:
    """The dense mesh ``(pp, dp, tp)`` (``(pp, dp, cp, tp)`` with context parallelism) and the expert view
    ``(pp, edp, ep)`` over the same ranks.

    Example:
        >>> # not run: needs a process group
        >>> mesh = build_mesh(ParallelDims.from_world(1), "cpu")  # doctest: +SKIP
        >>> mesh["tp"].size()  # doctest: +SKIP
        1
    """

    dims: ParallelDims
    dense: "DeviceMesh"
    expert: "DeviceMesh"
    flat_dp: Optional["DeviceMesh"] = None  # HSDP: dp_replicate × dp_shard as one dimension
    dp_cp: Optional["DeviceMesh"] = None  # cp > 1: dp × cp as one dimension (gradients, loss, metrics)
    hsdp_cp: Optional["DeviceMesh"] = None  # HSDP with cp: (dp_replicate, dp_shard × cp), what FSDP2 wraps over

    def __getitem__(self, name: Union[str, Axis]) -> "DeviceMesh":
        name = name.value if isinstance(name, Axis) else name
        if name in ("edp", "ep"):
            return self.expert[name]
        if name == "dp" and self.flat_dp is not None:
            return self.flat_dp
        if name == "dp_cp":
            return self.dp_cp if self.dp_cp is not None else self["dp"]
        return self.dense[name]

    @property
    def data_parallel(self) -> "DeviceMesh":
        """The mesh dense parameters are data-parallel over: ``dp``, the flattened ``dp × cp`` with context
        parallelism, or the 2-D ``(dp_replicate, dp_shard)`` under HSDP (FSDP2 then shards over the second
        dimension and replicates over the first), ``(dp_replicate, dp_shard × cp)`` under HSDP with context
        parallelism (TorchTitan's ``dp_shard_cp``)."""
        if self.hsdp_cp is not None:
            return self.hsdp_cp
        if self.dp_cp is not None:
            return self.dp_cp
        if self.dims.dp_shard is None:
            return self.dense["dp"]
        return self.dense["dp_replicate", "dp_shard"]

    def rank(self, name: Union[str, Axis]) -> int:
        """This process's coordinate on an axis."""
        return self[name].get_local_rank()


# Meshes built in this process, by what fixes their process groups: a second fit of the same layout (a sweep, a
# notebook, a test world running many specs) reuses the groups instead of opening new communicators (each an
# NCCL communicator's memory, or gloo's threads) that nothing ever closes. Dropped once a group is destroyed.
_BUILT: dict[tuple, tuple[FourDMesh, list]] = {}


def _groups_key(dims: ParallelDims, device_type: str, backend: str, timeout: Optional["timedelta"]) -> tuple:
    """What decides a mesh's process groups (not sequence parallelism or virtual stages)."""
    import torch.distributed as dist

    return (dist.get_rank(), dims.world_size, dims.tp, dims.pp, dims.ep, dims.dp, dims.dp_shard, dims.cp, device_type,
            backend, timeout)


def build_mesh(
    dims: ParallelDims, device_type: str, backend: Optional[str] = None, timeout: Optional["timedelta"] = None
) -> FourDMesh:
    """Build the dense and expert device meshes. Needs an initialised default process group.

    A layout built before in this process, whose process groups are still alive, gets those groups again (with
    ``dims`` as given): several fits in one process do not pile up communicators.

    Example:
        >>> # not run: needs a process group
        >>> mesh = build_mesh(ParallelDims.from_world(8, tp=2, pp=2, ep=2), "cpu")  # doctest: +SKIP
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised default process group (torch.distributed).")
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"The process group has {dist.get_world_size()} ranks but the degrees describe {dims.world_size}."
        )
    from lightning_4d._compat import mesh_groups

    backend = backend or dist.get_backend()
    key = _groups_key(dims, device_type, backend, timeout)
    built, groups = _BUILT.pop(key, (None, []))
    now = mesh_groups(_meshes_of(built)) if built is not None else None
    if now is not None and len(now) == len(groups) and all(a is b() for a, b in zip(now, groups)):
        _BUILT[key] = (built, groups)
        return dataclasses.replace(built, dims=dims)
    mesh = _new_mesh(dims, device_type, backend, timeout)
    _BUILT[key] = (mesh, [weakref.ref(g) for g in mesh_groups(_meshes_of(mesh)) or []])
    return mesh


def _meshes_of(mesh: FourDMesh) -> list["DeviceMesh"]:
    return [m for m in (mesh.dense, mesh.expert, mesh.flat_dp, mesh.dp_cp, mesh.hsdp_cp) if m is not None]


def _new_mesh(dims: ParallelDims, device_type: str, backend: str, timeout: Optional["timedelta"]) -> FourDMesh:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_4d._compat import flatten_mesh, mesh_backend_override, unflatten_mesh

    override = mesh_backend_override(backend, timeout, 5)
    one = override[0] if override is not None else None
    # Dense axes inside a pipeline stage (tp innermost); the expert view splits the same ranks into (edp, ep).
    dp: tuple[tuple[str, int], ...] = (("dp", dims.dp),) if dims.dp_shard is None else \
        (("dp_replicate", dims.dp_replicate), ("dp_shard", dims.dp_shard))
    inner = (*dp, *((("cp", dims.cp),) if dims.cp > 1 else ()), ("tp", dims.tp))
    names, sizes = tuple(n for n, _ in inner), tuple(s for _, s in inner)
    ranks = torch.arange(dims.world_size)
    # One root (pp, stage ranks): the dense mesh and the expert view both unflatten its second axis, so they share
    # its pp groups (a second DeviceMesh would create them again: one more communicator per rank). The second
    # axis itself communicates nothing: a "fake" group, no communicator.
    root = DeviceMesh(device_type, ranks.view(dims.pp, -1), mesh_dim_names=("pp", "stage"),
                      backend_override=(one or (None, None), ("fake", None)))
    dense = unflatten_mesh(root, "stage", sizes, names, override[:len(names)] if override is not None else None)
    expert = unflatten_mesh(root, "stage", (dims.edp, dims.ep), ("edp", "ep"),
                            override[:2] if override is not None else None)
    if dense is None or expert is None:  # a torch without DeviceMesh._unflatten: two meshes (pp groups twice)
        kwargs = {"backend_override": override[:len(names) + 1]} if override is not None else {}
        dense = DeviceMesh(device_type, ranks.view(dims.pp, *sizes), mesh_dim_names=("pp", *names), **kwargs)
        kwargs = {"backend_override": override[:3]} if override is not None else {}
        expert = DeviceMesh(device_type, ranks.view(dims.pp, dims.edp, dims.ep), mesh_dim_names=("pp", "edp", "ep"),
                            **kwargs)
    flat_dp, dp_cp, hsdp_cp = None, None, None
    if dims.cp > 1 and dims.dp_shard is not None:  # HSDP with cp: FSDP2 shards over dp_shard × cp (TorchTitan's)
        flat_dp = flatten_mesh(dense, ("dp_replicate", "dp_shard"), "dp", one)
        dp_cp = flatten_mesh(dense, ("dp_replicate", "dp_shard", "cp"), "dp_cp", one)
        hsdp_cp = unflatten_mesh(dp_cp, "dp_cp", (dims.dp_replicate, dims.dp_shard * dims.cp),  # type: ignore[operator]
                                 ("dp_replicate", "dp_shard_cp"), override[:2] if override is not None else None)
        if hsdp_cp is None:  # a torch without DeviceMesh._unflatten: `dense` is a root mesh, sliced by name
            flatten_mesh(dense, ("dp_shard", "cp"), "dp_shard_cp", one)
            hsdp_cp = dense["dp_replicate", "dp_shard_cp"]
    elif dims.cp > 1:  # "dp_cp": the ranks holding different tokens of the same parameters
        dp_cp = flatten_mesh(dense, ("dp", "cp"), "dp_cp", one)
    elif dims.dp_shard is not None:  # HSDP: "dp" is the flattened union of (replicate, shard): loss, metrics, checks
        flat_dp = flatten_mesh(dense, ("dp_replicate", "dp_shard"), "dp", one)
    return FourDMesh(dims, dense, expert, flat_dp, dp_cp, hsdp_cp)
