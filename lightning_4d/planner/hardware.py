"""Devices and clusters the planner lays a model out on, and which mesh axes cross nodes.

Rank order is the package's (``lightning_4d.mesh``): dense mesh ``(pp, dp, tp)`` and expert view
``(pp, edp, ep)``, innermost last. Global rank ``r`` lives on node ``r // gpus_per_node``. A mesh
axis *crosses nodes* when its process group (ranks ``base + k·stride``) spans more than one node;
its messages then go over the inter-node network (InfiniBand / RoCE) instead of NVLink.

Bandwidths are *per GPU, per direction* (bytes a rank can send per second): an H100/H200 SXM has
NVLink 4 with 900 GB/s bidirectional, i.e. 450 GB/s per direction, and usually one 400 Gb/s NIC
(50 GB/s) per GPU. Peak throughput is the dense bf16 tensor-core figure (989 TFLOP/s for both).

Example:
    >>> c = ClusterSpec(nodes=2, gpus_per_node=8, device=H100)
    >>> c.world_size, c.device.memory_bytes / 1e9
    (16, 80.0)
    >>> from lightning_4d.mesh import ParallelDims
    >>> axes_crossing_nodes(ParallelDims.from_world(16, tp=8, pp=2), c)
    {'tp': False, 'dp': False, 'pp': True, 'ep': False, 'edp': False}
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_4d.mesh import ParallelDims

__all__ = ["DeviceSpec", "ClusterSpec", "H100", "H200", "CPU_TOY", "axis_group", "axes_crossing_nodes",
           "axis_bandwidth"]


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    Args:
        name: label for tables.
        memory_bytes: device memory.
        peak_flops: dense 16-bit tensor throughput (FLOP/s).
        intra_node_bw: bytes/s per direction to a GPU of the same node (NVLink).
        inter_node_bw: bytes/s per direction to another node (the GPU's NIC share).
        usable_fraction: share of ``memory_bytes`` the planner lets a layout use (allocator
            fragmentation, CUDA context, NCCL buffers take the rest).
        compute_efficiency: achievable share of ``peak_flops`` for the model's matmuls.
        latency_intra / latency_inter: seconds per collective call (alpha term).

    Example:
        >>> H200.memory_bytes > H100.memory_bytes
        True
    """

    name: str
    memory_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    usable_fraction: float = 0.9
    compute_efficiency: float = 0.6
    latency_intra: float = 10e-6
    latency_inter: float = 20e-6

    @property
    def usable_bytes(self) -> float:
        """Memory a layout may use: ``memory_bytes · usable_fraction``."""
        return self.memory_bytes * self.usable_fraction

    def with_(self, **changes: Any) -> "DeviceSpec":
        """A copy with some fields changed (e.g. another memory size)."""
        return replace(self, **changes)


H100 = DeviceSpec("H100-SXM-80GB", 80e9, 989e12, 450e9, 50e9)
H200 = DeviceSpec("H200-SXM-141GB", 141e9, 989e12, 450e9, 50e9)
CPU_TOY = DeviceSpec("toy", 1e9, 1e12, 100e9, 10e9, usable_fraction=1.0, compute_efficiency=1.0,
                     latency_intra=0.0, latency_inter=0.0)


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes × gpus_per_node`` identical devices.

    Example:
        >>> ClusterSpec(4, 8, H200).world_size
        32
    """

    nodes: int
    gpus_per_node: int
    device: DeviceSpec = H100

    def __post_init__(self) -> None:
        for n in ("nodes", "gpus_per_node"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{n}={v!r} must be a positive integer.")

    @property
    def world_size(self) -> int:
        """Total ranks."""
        return self.nodes * self.gpus_per_node

    def with_(self, **changes: Any) -> "ClusterSpec":
        """A copy with some fields changed."""
        return replace(self, **changes)


def axis_group(dims: ParallelDims, axis: str, rank: int = 0) -> list[int]:
    """Global ranks of ``rank``'s process group along ``axis`` (pure; the package's rank order).

    Example:
        >>> axis_group(ParallelDims.from_world(8, tp=2, pp=2), "dp", rank=1)
        [1, 3]
        >>> axis_group(ParallelDims.from_world(8, tp=2, pp=2, ep=2), "edp", rank=0)
        [0, 2]
    """
    inner = dims.dp * dims.tp
    pp_i, rest = divmod(rank, inner)
    sizes = {"tp": (dims.tp, 1), "dp": (dims.dp, dims.tp), "pp": (dims.pp, inner),
             "ep": (dims.ep, 1), "edp": (dims.edp, dims.ep)}
    if axis not in sizes:
        raise ValueError(f"axis={axis!r} is not a mesh axis; use one of {sorted(sizes)}.")
    size, stride = sizes[axis]
    if axis == "pp":
        return [rest + k * inner for k in range(size)]
    base = pp_i * inner + (rest % stride) + (rest // (stride * size)) * stride * size
    return [base + k * stride for k in range(size)]


def axes_crossing_nodes(dims: ParallelDims, cluster: ClusterSpec) -> dict[str, bool]:
    """For every axis, whether any of its groups spans more than one node.

    Example:
        >>> axes_crossing_nodes(ParallelDims.from_world(16, tp=4, ep=8), ClusterSpec(2, 8))["ep"]
        False
    """
    g = cluster.gpus_per_node
    out = {}
    for axis in ("tp", "dp", "pp", "ep", "edp"):
        seen: set[int] = set()
        out[axis] = False
        for r in range(dims.world_size):  # every group once
            if r in seen:
                continue
            group = axis_group(dims, axis, r)
            seen.update(group)
            if len({x // g for x in group}) > 1:
                out[axis] = True
                break
    return out


def axis_bandwidth(dims: ParallelDims, cluster: ClusterSpec) -> dict[str, float]:
    """Bytes/s per direction each axis's messages get: NVLink inside a node, the NIC across nodes.

    Example:
        >>> axis_bandwidth(ParallelDims.from_world(16, tp=8, pp=2), ClusterSpec(2, 8, H100))["pp"] / 1e9
        50.0
    """
    cross = axes_crossing_nodes(dims, cluster)
    d = cluster.device
    return {a: (d.inter_node_bw if c else d.intra_node_bw) for a, c in cross.items()}
