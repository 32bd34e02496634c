"""The processes' group and the 4D mesh, for both strategies (the Trainer's and Fabric's ``setup_environment``).

Example:
    >>> # not run: needs a process group (a cluster environment)
    >>> mesh, backend = connect_mesh(env, FourDConfig(tp=2), 4, torch.device("cpu"), "Fabric")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from lightning_4d import _compat
from lightning_4d.config import FourDConfig
from lightning_4d.core.distributed import connect
from lightning_4d.mesh import Axis, FourDMesh, ParallelDims, build_mesh
from lightning_4d.safety.nccl_debug import enable_flight_recorder

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshProperties", "connect_mesh"]


class MeshProperties:
    """The properties both strategies share (put it before Lightning's ``ParallelStrategy`` in the bases): the
    processes of this node and its device, the mesh and its degrees, the data-parallel sampler. The strategy sets
    ``_num_nodes``, ``_mesh`` (in ``setup_environment``) and ``_process_group_backend``.

    Example:
        >>> from lightning_4d import FourDStrategy
        >>> FourDStrategy().num_nodes
        1
    """

    _num_nodes: int
    _mesh: Optional[FourDMesh]
    _process_group_backend: Optional[str]
    parallel_devices: Optional[list[torch.device]]
    local_rank: int

    @property
    def num_nodes(self) -> int:
        """Number of nodes (set by the Trainer or Fabric)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def mesh(self) -> FourDMesh:
        """The dense ``(pp, dp, tp)`` mesh and the expert ``(pp, edp, ep)`` view."""
        if self._mesh is None:
            raise RuntimeError("The 4D mesh exists only once the processes are set up (by `trainer.fit(...)` or "
                               "`fabric.launch()`).")
        return self._mesh

    @property
    def dims(self) -> ParallelDims:
        """The validated degrees (available after ``setup_environment``)."""
        return self.mesh.dims

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The dense DeviceMesh with axes ``("pp", "dp", "tp")``."""
        return self.mesh.dense

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """TP, PP and CP peers get the same samples (cp splits each sequence in the step): the data is sharded over
        the dp axis only."""
        return {"num_replicas": self.dims.dp, "rank": self.mesh.rank(Axis.DP)}

    @property
    def process_group_backend(self) -> Optional[str]:
        """The backend of the default process group."""
        return self._process_group_backend


def connect_mesh(env: ClusterEnvironment, config: FourDConfig, world_size: int, device: torch.device,
                 who: str = "the Trainer") -> tuple[FourDMesh, str]:
    """Validate ``config``'s degrees against ``world_size`` (pure: a bad layout fails on every rank before any
    collective), join the default process group (an existing one is reused; backend: the option, else by device;
    NCCL's flight recorder on unless ``config.nccl_flight_recorder`` is off: :func:`~lightning_4d.core.distributed.
    connect`) and build the mesh; returns it and the backend. ``who`` asked for ``world_size`` (named by the error).

    Raises:
        ValueError: the degrees do not fit the world, or an existing group has another size.

    Example:
        >>> # not run: needs a process group (a cluster environment)
        >>> connect_mesh(env, FourDConfig(tp=2), 4, torch.device("cpu"))[0].dims.dp  # doctest: +SKIP
        2
    """
    dims = config.resolve(world_size)
    backend = config.process_group_backend or _compat.default_pg_backend(device)
    if config.nccl_flight_recorder:
        enable_flight_recorder()  # before NCCL starts: it reads the environment then
    connect(env, backend, config.timeout, device)
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"The existing process group has {dist.get_world_size()} ranks but {who} asks for {world_size} "
            f"(devices × num_nodes). Make them equal."
        )
    return build_mesh(dims, device.type, backend=backend, timeout=config.timeout), backend
