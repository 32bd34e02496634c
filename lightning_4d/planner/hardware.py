"""Devices and clusters the planner lays a model out on, and which mesh axes cross nodes.

Rank order is the package's (``lightning_4d.mesh``): dense mesh ``(pp, dp, tp)`` and expert view
``(pp, edp, ep)``, innermost last. Global rank ``r`` lives on node ``r // gpus_per_node``. A mesh
axis *crosses nodes* when its process group (ranks ``base + k·stride``) spans more than one node;
its messages then go over the inter-node network (InfiniBand / RoCE) instead of NVLink.

Bandwidths are *per GPU, per direction* (bytes a rank can send per second): an H100/H200 SXM has
NVLink 4 with 900 GB/s bidirectional, i.e. 450 GB/s per direction, and usually one 400 Gb/s NIC
(50 GB/s) per GPU. Peak throughput is the dense bf16 tensor-core figure (989 TFLOP/s for both).

Devices are selectable by name (:data:`DEVICES`, :func:`device_by_name`; ``plan.device=NAME`` in
``recipes/plan.py``). Each belongs to a :class:`DeviceFamily` whose constants (the large-GEMM efficiency,
the GEMM intensity at half of it, the allocator's slack, the usable share of memory, collective latencies)
were calibrated once for the family (``docs/planner_calibration.md``) and are shared by every part of it;
a device adds its datasheet numbers (memory, peak, NVLink, NIC, HBM). :func:`custom_device` builds a
device from its numbers and a family (or an explicit efficiency).

Example:
    >>> c = ClusterSpec(nodes=2, gpus_per_node=8, device=H100)
    >>> c.world_size, c.device.memory_bytes / 1e9
    (16, 80.0)
    >>> from lightning_4d.mesh import ParallelDims
    >>> axes_crossing_nodes(ParallelDims.from_world(16, tp=8, pp=2), c)
    {'tp': False, 'dp': False, 'pp': True, 'ep': False, 'edp': False}
    >>> device_by_name("A100-40GB").family, device_by_name("A100-40GB").compute_efficiency
    ('ampere', 0.74)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Optional, Union

from lightning_4d.mesh import ParallelDims

__all__ = ["DeviceFamily", "DeviceSpec", "ClusterSpec", "FAMILIES", "DEVICES", "DEVICE_ALIASES", "device_by_name",
           "device_names", "custom_device", "A100", "A100_40GB", "H100", "H100_PCIE", "H100_NVL", "H100_HBM2E_500W",
           "H200", "H800", "CPU", "CPU_TOY", "HOPPER_GEMM_EFFICIENCY", "AMPERE_GEMM_EFFICIENCY", "axis_group",
           "axes_crossing_nodes"]


@dataclass(frozen=True)
class DeviceFamily:
    """Constants shared by every device of one architecture, calibrated once for the family.

    Args:
        name: ``"ampere"``, ``"hopper"``, ``"cpu"`` (or ``"custom"``).
        compute_efficiency: share of the peak a large GEMM reaches (saturation of
            :func:`lightning_4d.planner.compute.gemm_efficiency`).
        gemm_half_intensity: GEMM arithmetic intensity (FLOP/byte) at half of ``compute_efficiency``.
        usable_fraction: share of device memory the allocator may reserve.
        allocator_overhead: reserved / allocated bytes at the peak, on top of allocated.
        latency_intra / latency_inter: seconds per collective call inside / across nodes.
        latency_dp: seconds per data-parallel (FSDP) collective call when they differ from the others (CPU: FSDP's
            own host work around each all-gather / reduce-scatter); ``None``: ``latency_intra`` / ``latency_inter``.
        layer_overhead: seconds of framework (host) time per block and micro-batch, forward + backward,
            that no device work hides (0 on GPUs: kernel launches run ahead of the device).
        step_overhead: host seconds per optimizer step besides the blocks (the training loop, logging, the
            optimizer's Python; 0 on GPUs).
        attention_efficiency: the attention kernel's throughput as a share of a GEMM of the same shape (1 where
            the calibration folds it into ``compute_efficiency``: the GPU families).
        runtime_bytes: resident bytes a training rank adds besides its tensors (autograd engine, thread pools,
            allocator arenas; 0 on GPUs, whose reserved memory the allocator reports without them).
        calibrated_on: where the constants come from (printed with every plan).

    Example:
        >>> FAMILIES["hopper"].compute_efficiency, FAMILIES["ampere"].calibrated_on[:8]
        (0.6, 'Megatron')
    """

    name: str
    compute_efficiency: float
    gemm_half_intensity: float = 60.0
    usable_fraction: float = 0.95
    allocator_overhead: float = 0.1
    latency_intra: float = 10e-6
    latency_inter: float = 20e-6
    latency_dp: Optional[float] = None
    layer_overhead: float = 0.0
    step_overhead: float = 0.0
    attention_efficiency: float = 1.0
    runtime_bytes: float = 0.0
    calibrated_on: str = ""


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
        latency_dp: seconds per data-parallel collective call, when not the others' (:class:`DeviceFamily`).
        hbm_bw: device memory bandwidth (bytes/s) for memory-bound kernels and the optimizer step.
        gemm_half_intensity: GEMM arithmetic intensity (FLOP/byte) at which a GEMM reaches half of
            ``compute_efficiency``.
        allocator_overhead: reserved / allocated bytes of the caching allocator at the peak
            (fragmentation between differently sized blocks), as a fraction on top of allocated.
        family: the :class:`DeviceFamily` the family constants came from (``"custom"``: none).
        layer_overhead: host seconds per block and micro-batch (forward + backward) no device work hides
            (:class:`DeviceFamily`; 0 for GPUs).
        step_overhead: host seconds per optimizer step besides the blocks (:class:`DeviceFamily`).
        attention_efficiency: attention kernel throughput / a GEMM of the same shape (:class:`DeviceFamily`).
        runtime_bytes: resident bytes a training rank adds besides its tensors (:class:`DeviceFamily`).
        cores: compute units the ranks of one node share (CPU: cores; ``None``: one device per rank).
            With fewer cores than ranks per node the ranks take turns: see
            :func:`lightning_4d.planner.roofline.estimate_step`.
        note: where the datasheet numbers come from.

    Example:
        >>> H200.memory_bytes > H100.memory_bytes, H100.memory_fraction, H100.family
        (True, 0.95, 'hopper')
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
    latency_dp: Optional[float] = None
    family: str = "custom"
    layer_overhead: float = 0.0
    step_overhead: float = 0.0
    attention_efficiency: float = 1.0
    runtime_bytes: float = 0.0
    cores: Optional[int] = None
    note: str = ""

    @property
    def usable_bytes(self) -> float:
        """Memory a layout may reserve: ``memory_bytes · usable_fraction``."""
        return self.memory_bytes * self.usable_fraction

    @property
    def memory_fraction(self) -> float:
        """Share of device memory the planner lets the allocator reserve (``usable_fraction``)."""
        return self.usable_fraction

    def constants(self) -> dict[str, Union[float, str, None]]:
        """Every model constant of the device, for reports.

        Example:
            >>> sorted(H100.constants())[:3]
            ['allocator_overhead', 'attention_efficiency', 'compute_efficiency']
        """
        return {"compute_efficiency": self.compute_efficiency, "gemm_half_intensity": self.gemm_half_intensity,
                "memory_fraction": self.usable_fraction, "allocator_overhead": self.allocator_overhead,
                "peak_flops": self.peak_flops, "hbm_bw": self.hbm_bw, "intra_node_bw": self.intra_node_bw,
                "inter_node_bw": self.inter_node_bw, "latency_intra": self.latency_intra,
                "latency_inter": self.latency_inter, "memory_bytes": self.memory_bytes, "family": self.family,
                "layer_overhead": self.layer_overhead, "attention_efficiency": self.attention_efficiency,
                "runtime_bytes": self.runtime_bytes, "step_overhead": self.step_overhead,
                "latency_dp": self.latency_dp, "cores": self.cores}

    def describe(self) -> str:
        """One line naming the device, its family and the constants a plan used.

        Example:
            >>> print(A100_40GB.describe())  # doctest: +ELLIPSIS
            A100-SXM-40GB (family ampere: compute_efficiency 0.74, ...), peak 312 TFLOP/s, memory 40 GB ...
        """
        fam = FAMILIES.get(self.family)
        source = f"; calibrated on {fam.calibrated_on}" if fam is not None and fam.calibrated_on else ""
        text = (f"{self.name} (family {self.family}: compute_efficiency {self.compute_efficiency:g}, "
                f"gemm_half_intensity {self.gemm_half_intensity:g}, allocator_overhead {self.allocator_overhead:g}"
                f"{source}), peak {self.peak_flops / 1e12:.4g} TFLOP/s, memory {self.memory_bytes / 1e9:.4g} GB "
                f"({self.usable_fraction:g} usable), HBM {self.hbm_bw / 1e9:.4g} GB/s, intra-node "
                f"{self.intra_node_bw / 1e9:.4g} GB/s, inter-node {self.inter_node_bw / 1e9:.4g} GB/s, latency "
                f"{self.latency_intra * 1e6:.4g}/{self.latency_inter * 1e6:.4g} us per call"
                + (f" ({self.latency_dp * 1e6:.4g} us per data-parallel call)" if self.latency_dp is not None else ""))
        if self.layer_overhead:
            text += (f", host overhead {self.layer_overhead * 1e3:.3g} ms per block and micro-batch and "
                     f"{self.step_overhead * 1e3:.3g} ms per step")
        if self.attention_efficiency != 1.0:
            text += f", attention at {self.attention_efficiency:g} of a GEMM's rate"
        if self.runtime_bytes:
            text += f", {self.runtime_bytes / 2**20:.3g} MiB runtime per rank"
        if self.cores is not None:
            text += f", {self.cores} shared cores per node"
        return text

    def with_(self, **changes: Any) -> "DeviceSpec":
        """A copy with some fields changed (e.g. another memory size)."""
        return replace(self, **changes)


#: Large-GEMM efficiency of the Hopper parts, calibrated on TorchTitan's Llama 3.1 8B runs
#: (``docs/planner_calibration.md``; one constant for all rows of the device family).
HOPPER_GEMM_EFFICIENCY = 0.6
#: Large-GEMM efficiency of the Ampere parts, calibrated on Megatron-LM's SC21 Table 1.
AMPERE_GEMM_EFFICIENCY = 0.74

#: The families and their calibrated constants (``plan.family`` for a custom device).
FAMILIES: dict[str, DeviceFamily] = {
    "ampere": DeviceFamily("ampere", AMPERE_GEMM_EFFICIENCY,
                           calibrated_on="Megatron-LM SC21 Table 1 (A100 80GB, GPT 1.7B-1T)"),
    "hopper": DeviceFamily("hopper", HOPPER_GEMM_EFFICIENCY,
                           calibrated_on="TorchTitan's Llama 3.1 8B H100 runs (2024-12)"),
    # CPU ranks of one host, fp32, gloo over loopback, in CPU seconds (a loaded machine stretches wall-clock time,
    # not these), on this repository's 2-core x86-64 CI machine (docs/planner_calibration.md, "This machine"):
    # micro-benchmarks (`python bench/calibrate_planner_cpu.py --constants`): one core's fp32 GEMM ~78 GFLOP/s
    # at every shape of the CPU rows (flat: half intensity 5), causal SDPA 0.38 of a GEMM of its shape, the
    # package's Llama block forward + backward at width 16 ~1.0 ms of framework time, resident memory 1.40 x the
    # live allocations (glibc keeps freed blocks); and the negligible-width training rows (`--derive`): 10 ms of
    # framework time per optimizer step, 2.0 ms per collective call (DTensor, pipeline, all-to-all), 4.5 ms per
    # FSDP call, 25 MiB of runtime per rank.
    "cpu": DeviceFamily("cpu", 1.0, gemm_half_intensity=5.0, usable_fraction=1.0, allocator_overhead=0.40,
                        latency_intra=2.0e-3, latency_inter=2.0e-3, latency_dp=4.5e-3, layer_overhead=1.0e-3,
                        step_overhead=10e-3, attention_efficiency=0.38, runtime_bytes=25 * 2**20,
                        calibrated_on="micro-benchmarks and negligible-width runs on this repository's CPU CI machine "
                                      "(bench/calibrate_planner_cpu.py --constants, --derive)"),
}


def _part(name: str, family: str, memory_bytes: float, peak_flops: float, intra_node_bw: float, inter_node_bw: float,
          hbm_bw: float, note: str, **extra: Optional[float]) -> DeviceSpec:
    """A named part: its datasheet numbers and its family's calibrated constants."""
    fam = FAMILIES[family]
    consts = {f.name: getattr(fam, f.name) for f in fields(DeviceFamily) if f.name not in ("name", "calibrated_on")}
    consts.update(extra)
    return DeviceSpec(name, memory_bytes, peak_flops, intra_node_bw, inter_node_bw, hbm_bw=hbm_bw, family=family,
                      note=note, **consts)


#: NVIDIA H100 SXM 80 GB: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, NVLink 4 450 GB/s per direction, 400 Gb/s NIC.
H100 = _part("H100-SXM-80GB", "hopper", 80e9, 989e12, 450e9, 50e9, 3.35e12,
             "H100 SXM5 datasheet: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, NVLink 4 900 GB/s bidirectional; "
             "one 400 Gb/s NIC per GPU")
#: NVIDIA H100 PCIe 80 GB: 756 TFLOP/s dense bf16, HBM2e 2.0 TB/s; GPUs of a node talk over PCIe Gen5 x16
#: (64 GB/s per direction; NVLink bridges join pairs only), one 400 Gb/s NIC per GPU.
H100_PCIE = _part("H100-PCIe-80GB", "hopper", 80e9, 756e12, 64e9, 50e9, 2.0e12,
                  "H100 PCIe datasheet: 756 TFLOP/s dense bf16, HBM2e 2.0 TB/s, PCIe Gen5 x16 between GPUs")
#: NVIDIA H100 NVL 94 GB: 835 TFLOP/s dense bf16, HBM3 3.9 TB/s; PCIe Gen5 between GPUs (NVLink bridges pairs).
H100_NVL = _part("H100-NVL-94GB", "hopper", 94e9, 835e12, 64e9, 50e9, 3.9e12,
                 "H100 NVL datasheet: 835 TFLOP/s dense bf16, HBM3 3.9 TB/s, PCIe Gen5 x16 between GPUs")
#: NVIDIA H200 SXM 141 GB: the H100's compute with HBM3e 4.8 TB/s.
H200 = _part("H200-SXM-141GB", "hopper", 141e9, 989e12, 450e9, 50e9, 4.8e12,
             "H200 SXM datasheet: 989 TFLOP/s dense bf16, HBM3e 4.8 TB/s, NVLink 4 900 GB/s bidirectional")
#: NVIDIA H800 SXM 80 GB (DeepSeek-V3's cluster): the H100's compute with NVLink cut to 400 GB/s bidirectional.
H800 = _part("H800-SXM-80GB", "hopper", 80e9, 989e12, 200e9, 50e9, 3.35e12,
             "H800 SXM: H100 compute and HBM3, NVLink 400 GB/s bidirectional; one 400 Gb/s NIC per GPU")
#: The H100 of TorchTitan's published benchmarks (Grand Teton): 96 GB HBM2e at 2.4 TB/s run at a 500 W
#: power limit instead of 700 W; its sustained peak is taken as 989 TFLOP/s scaled by the power limit
#: (tensor-core clocks throttle roughly in proportion under a GEMM load): 706 TFLOP/s.
H100_HBM2E_500W = _part("H100-96GB-HBM2e-500W", "hopper", 96 * 2**30, 989e12 * 500 / 700, 450e9, 50e9, 2.4e12,
                        "TorchTitan benchmarks/llama3_h100_202412: 96 GB HBM2e 2.4 TB/s, 500 W power limit "
                        "(peak scaled 500/700)")
#: NVIDIA A100 SXM 80 GB (DGX A100, Selene): 312 TFLOP/s dense bf16/fp16, HBM2e 2.04 TB/s, NVLink 3
#: 300 GB/s per direction, one 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s). ``compute_efficiency``
#: calibrated on Megatron-LM's SC21 Table 1.
A100 = _part("A100-SXM-80GB", "ampere", 80e9, 312e12, 300e9, 25e9, 2.039e12,
             "A100 SXM4 80GB datasheet: 312 TFLOP/s dense bf16, HBM2e 2.04 TB/s, NVLink 3 600 GB/s bidirectional; "
             "one 200 Gb/s HDR NIC per GPU")
#: NVIDIA A100 SXM 40 GB: the 80 GB part's compute with HBM2 1.56 TB/s.
A100_40GB = _part("A100-SXM-40GB", "ampere", 40e9, 312e12, 300e9, 25e9, 1.555e12,
                  "A100 SXM4 40GB datasheet: 312 TFLOP/s dense bf16, HBM2 1.56 TB/s, NVLink 3 600 GB/s "
                  "bidirectional; one 200 Gb/s HDR NIC per GPU")
#: One CPU rank of a host where ranks share ``cores`` cores (gloo over loopback, fp32): measured on this
#: repository's 2-core CI machine (``bench/calibrate_planner_cpu.py --constants``; docs/planner_calibration.md).
#: ``peak_flops``: one core's fp32 GEMM throughput; ``hbm_bw``: one core's copy bandwidth; the bandwidths:
#: gloo all-gather between two ranks; ``memory_bytes``: the host's memory (each rank's peak is compared
#: with it: a plan of n ranks on one host also needs n × the per-rank peak, see ``plan.nodes``).
CPU = _part("cpu", "cpu", 16e9, 78e9, 0.41e9, 0.41e9, 40e9,
            "one core of this repository's 2-core x86-64 CI machine: fp32 GEMM 78 GFLOP/s, elementwise 40 GB/s; "
            "gloo + FSDP move 0.41 GB per CPU second (bench/calibrate_planner_cpu.py --constants, --derive)", cores=2)
CPU_TOY = DeviceSpec("toy", 1e9, 1e12, 100e9, 10e9, usable_fraction=1.0, compute_efficiency=1.0,
                     latency_intra=0.0, latency_inter=0.0, hbm_bw=1e30, gemm_half_intensity=0.0,
                     allocator_overhead=0.0)

#: Devices by the name ``plan.device`` takes.
DEVICES: dict[str, DeviceSpec] = {
    "A100-40GB": A100_40GB, "A100-80GB": A100, "H100-SXM": H100, "H100-PCIe": H100_PCIE, "H100-NVL": H100_NVL,
    "H100-96GB-500W": H100_HBM2E_500W, "H200": H200, "H800": H800, "cpu": CPU,
}
#: Other accepted spellings: the short names and each device's own label.
DEVICE_ALIASES: dict[str, str] = {"A100": "A100-80GB", "H100": "H100-SXM",
                                  **{d.name: k for k, d in DEVICES.items()}}


def device_names() -> list[str]:
    """Every name :func:`device_by_name` accepts (``custom`` is built by :func:`custom_device`).

    Example:
        >>> "H100-PCIe" in device_names() and "H100" in device_names()
        True
    """
    return sorted({*DEVICES, *DEVICE_ALIASES})


def device_by_name(name: str) -> DeviceSpec:
    """The named device (:data:`DEVICES`, or an alias of :data:`DEVICE_ALIASES`).

    Raises:
        ValueError: an unknown name (the message lists the known ones and how to describe another).

    Example:
        >>> device_by_name("H100").name, round(device_by_name("H100-96GB-500W").peak_flops / 1e12, 1)
        ('H100-SXM-80GB', 706.4)
        >>> device_by_name("B300")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: device 'B300' is not known; use one of A100, ... or describe it as custom ...
    """
    key = DEVICE_ALIASES.get(name, name)
    if key not in DEVICES:
        raise ValueError(f"device {name!r} is not known; use one of {', '.join(device_names())}, or describe it as "
                         f"custom (memory, peak TFLOP/s, NVLink and NIC bandwidths and a family: "
                         f"{', '.join(sorted(FAMILIES))}, or a compute efficiency).")
    return DEVICES[key]


def custom_device(memory_gb: float, peak_tflops: float, nvlink_gb_s: float, nic_gb_s: float,
                  family: Optional[str] = None, compute_efficiency: Optional[float] = None,
                  hbm_gb_s: Optional[float] = None, name: str = "custom") -> DeviceSpec:
    """A device from its datasheet numbers and a family's calibrated constants (or an explicit efficiency).

    Args:
        memory_gb / peak_tflops / nvlink_gb_s / nic_gb_s: memory, dense 16-bit peak, bandwidths per direction.
        family: ``"ampere"``, ``"hopper"`` or ``"cpu"`` (:data:`FAMILIES`): its efficiency, latencies,
            allocator slack and usable memory share.
        compute_efficiency: the large-GEMM share of the peak; overrides the family's (required without one).
        hbm_gb_s: memory bandwidth (default: the family's reference part's per TFLOP/s, scaled to the peak).

    Raises:
        ValueError: neither a family nor an efficiency, or an unknown family.

    Example:
        >>> d = custom_device(96, 800, 450, 50, family="hopper")
        >>> d.family, d.compute_efficiency, round(d.hbm_bw / 1e12, 2)
        ('hopper', 0.6, 2.71)
        >>> custom_device(96, 800, 450, 50)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: a custom device needs a family (ampere, cpu, hopper) ...
    """
    if family is None and compute_efficiency is None:
        raise ValueError(f"a custom device needs a family ({', '.join(sorted(FAMILIES))}) for its calibrated "
                         f"constants, or an explicit compute_efficiency (share of the peak a large GEMM reaches, "
                         f"e.g. 0.6); set plan.family=hopper or plan.compute_efficiency=0.6.")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {', '.join(sorted(FAMILIES))}.")
    reference = {"ampere": A100, "hopper": H100, "cpu": CPU}.get(family or "", H100)
    bw = hbm_gb_s * 1e9 if hbm_gb_s is not None else reference.hbm_bw / reference.peak_flops * peak_tflops * 1e12
    if family is not None:
        dev = _part(name, family, memory_gb * 1e9, peak_tflops * 1e12, nvlink_gb_s * 1e9, nic_gb_s * 1e9, bw,
                    "custom device", cores=reference.cores if family == "cpu" else None)
    else:
        dev = DeviceSpec(name, memory_gb * 1e9, peak_tflops * 1e12, nvlink_gb_s * 1e9, nic_gb_s * 1e9, hbm_bw=bw,
                         note="custom device")
    return dev.with_(compute_efficiency=compute_efficiency) if compute_efficiency is not None else dev


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
    inner = dims.dp * dims.cp * dims.tp
    pp_i, rest = divmod(rank, inner)
    sizes = {"tp": (dims.tp, 1), "dp": (dims.dp, dims.cp * dims.tp), "pp": (dims.pp, inner),
             "ep": (dims.ep, 1), "edp": (dims.edp, dims.ep), "cp": (dims.cp, dims.tp), "dp_cp": (dims.dp_cp, dims.tp)}
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
