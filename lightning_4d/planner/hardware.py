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

__all__ = ["DeviceSpec", "ClusterSpec", "A100", "H100", "H100_HBM2E_500W", "H200", "CPU_TOY", "HOPPER_GEMM_EFFICIENCY",
           "axis_group", "axes_crossing_nodes", "axis_bandwidth"]


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator and the constants of the planner's time and memory models.

    Args:
        name: label for tables.
        memory_bytes: device memory.
        peak_flops: dense 16-bit tensor throughput (FLOP/s).
        intra_node_bw: bytes/s per direction to a GPU of the same node (NVLink).
        inter_node_bw: bytes/s per direction to another node (the GPU's NIC share).
        usable_fraction: share of ``memory_bytes`` torch's caching allocator may reserve (the CUDA
            context and NCCL buffers take the rest); also :attr:`memory_fraction`.
        compute_efficiency: share of ``peak_flops`` a large GEMM reaches (the saturation value of
            :func:`lightning_4d.planner.compute.gemm_efficiency`).
        latency_intra / latency_inter: seconds per collective call (alpha term).
        hbm_bw: device memory bandwidth (bytes/s) for memory-bound kernels and the optimizer step.
        gemm_half_intensity: GEMM arithmetic intensity (FLOP/byte) at which a GEMM reaches half of
            ``compute_efficiency``.
        allocator_overhead: reserved / allocated bytes of the caching allocator at the peak
            (fragmentation between differently sized blocks), as a fraction on top of allocated.

    Example:
        >>> H200.memory_bytes > H100.memory_bytes, H100.memory_fraction
        (True, 0.95)
    """

    name: str
    memory_bytes: float
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    usable_fraction: float = 0.95
    compute_efficiency: float = 0.8
    latency_intra: float = 10e-6
    latency_inter: float = 20e-6
    hbm_bw: float = 3.35e12
    gemm_half_intensity: float = 60.0
    allocator_overhead: float = 0.1

    @property
    def usable_bytes(self) -> float:
        """Memory a layout may reserve: ``memory_bytes · usable_fraction``."""
        return self.memory_bytes * self.usable_fraction

    @property
    def memory_fraction(self) -> float:
        """Share of device memory the planner lets the allocator reserve (``usable_fraction``)."""
        return self.usable_fraction

    def constants(self) -> dict[str, float]:
        """Every model constant of the device, for reports.

        Example:
            >>> sorted(H100.constants())[:3]
            ['allocator_overhead', 'compute_efficiency', 'gemm_half_intensity']
        """
        return {"compute_efficiency": self.compute_efficiency, "gemm_half_intensity": self.gemm_half_intensity,
                "memory_fraction": self.usable_fraction, "allocator_overhead": self.allocator_overhead,
                "peak_flops": self.peak_flops, "hbm_bw": self.hbm_bw, "intra_node_bw": self.intra_node_bw,
                "inter_node_bw": self.inter_node_bw, "latency_intra": self.latency_intra,
                "latency_inter": self.latency_inter, "memory_bytes": self.memory_bytes}

    def with_(self, **changes: Any) -> "DeviceSpec":
        """A copy with some fields changed (e.g. another memory size)."""
        return replace(self, **changes)


#: Large-GEMM efficiency of the Hopper parts, calibrated on TorchTitan's Llama 3.1 8B runs
#: (``docs/planner_calibration.md``; one constant for all rows of the device family).
HOPPER_GEMM_EFFICIENCY = 0.6
#: NVIDIA H100 SXM 80 GB: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, NVLink 4 450 GB/s per direction, 400 Gb/s NIC.
H100 = DeviceSpec("H100-SXM-80GB", 80e9, 989e12, 450e9, 50e9, hbm_bw=3.35e12,
                  compute_efficiency=HOPPER_GEMM_EFFICIENCY)
#: NVIDIA H200 SXM 141 GB: the H100's compute with HBM3e 4.8 TB/s.
H200 = DeviceSpec("H200-SXM-141GB", 141e9, 989e12, 450e9, 50e9, hbm_bw=4.8e12,
                  compute_efficiency=HOPPER_GEMM_EFFICIENCY)
#: NVIDIA A100 SXM 80 GB (DGX A100, Selene): 312 TFLOP/s dense bf16/fp16, HBM2e 2.04 TB/s, NVLink 3
#: 300 GB/s per direction, one 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s). ``compute_efficiency``
#: calibrated on Megatron-LM's SC21 Table 1.
A100 = DeviceSpec("A100-SXM-80GB", 80e9, 312e12, 300e9, 25e9, hbm_bw=2.039e12, compute_efficiency=0.74)
#: The H100 of TorchTitan's published benchmarks (Grand Teton): 96 GB HBM2e at 2.4 TB/s run at a 500 W
#: power limit instead of 700 W; its sustained peak is taken as 989 TFLOP/s scaled by the power limit
#: (tensor-core clocks throttle roughly in proportion under a GEMM load): 706 TFLOP/s.
H100_HBM2E_500W = DeviceSpec("H100-96GB-HBM2e-500W", 96 * 2**30, 989e12 * 500 / 700, 450e9, 50e9,
                             hbm_bw=2.4e12, compute_efficiency=HOPPER_GEMM_EFFICIENCY)
CPU_TOY = DeviceSpec("toy", 1e9, 1e12, 100e9, 10e9, usable_fraction=1.0, compute_efficiency=1.0,
                     latency_intra=0.0, latency_inter=0.0, hbm_bw=1e30, gemm_half_intensity=0.0,
                     allocator_overhead=0.0)


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
