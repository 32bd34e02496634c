"""The planner recipe's schema: the ``plan`` section (:class:`PlanConfig`) and the primary config of
``recipes/plan.py`` (:class:`PlanRecipeConfig`: the training config plus ``plan``).

Example:
    >>> PlanConfig().search
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from lightning_4d.recipes.errors import RecipeConfigError, _non_negative, _one_of, _positive
from lightning_4d.recipes.sections import TrainConfig

__all__ = ["PlanConfig", "PlanRecipeConfig"]


# ---------------------------------------------------------------------------------------------- plan
@dataclass
class PlanConfig:
    """The ``plan`` section of ``recipes/plan.py`` (``conf/plan.yaml``): the cluster and what to report.

    ``device``: a device by name (``lightning_4d.planner.hardware.DEVICES``: ``A100-40GB``, ``A100-80GB``,
    ``H100-SXM``, ``H100-PCIe``, ``H100-NVL``, ``H100-96GB-500W``, ``H200``, ``H800``, ``cpu``; ``A100`` and ``H100``
    are aliases) or ``custom`` (then ``memory_gb``, ``peak_tflops``, ``nvlink_gb_s``, ``infiniband_gb_s`` and a
    ``family`` — ``ampere``, ``hopper``, ``cpu``: its calibrated constants — or a ``compute_efficiency`` are
    required). Any of the numbers (and ``compute_efficiency``, ``hbm_gb_s``) also overrides a named device.
    Bandwidths are GB/s per GPU and direction (NVLink inside a node, the NIC share across nodes).
    ``cpu_cores``: with ``device=cpu``, the cores the ranks of a node share (``null``: the device's).
    ``nodes`` (``null``: the layout's world / ``gpus_per_node``) × ``gpus_per_node`` (``null``:
    ``trainer.devices``) is the cluster. ``global_batch_size`` / ``seq_len`` (``null``: from ``data``),
    ``expert_imbalance`` (>= 1, 1 = uniform routing). What the planner models beyond the runtime (labelled
    "planner only" in the plan): ``selective_policy`` (what ``parallel.activation_checkpointing=selective``
    saves: ``matmuls``, the runtime's, or TorchTitan's ``every_other_matmul``), ``data_parallel`` (``zero1`` / ``zero2`` instead of
    ``parallel.data_parallel``) and ``kernels=fused`` (what Megatron / Transformer Engine's fused kernels keep for
    backward instead of PyTorch's eager kernels). ``compile`` (``torch.compile``'d blocks) and ``float8`` (Float8
    linears) run in the runtime too (``parallel.compile=true``, ``parallel.float8=true``: either switch turns them
    on in the plan). ``search``: rank every layout of the cluster and show the ``top``
    ones; ``context_parallel``: the cp degrees it tries (each only where the model's attention and the sequence allow it,
    ranked like the rest; ``null``: every divisor of the world, ``[1]``: none).
    ``trace``: dry-run the real rewriting on a fake process group and compare traced bytes with the formulas,
    over ``trace_blocks`` blocks (``null``: the whole model up to 8 blocks) and the ranks ``trace_ranks``
    (``null``: one per pipeline rank). ``materialize_rank``: also set up that global rank for real in this process
    (fake process group, the whole model rewritten on meta, the rank's shards allocated and initialised:
    :func:`lightning_4d.planner.setup_rank.simulate_setup`) and print its measured peak memory and seconds next to
    the planner's set-up estimate (``null``: skip; needs host memory for one rank's share). ``output``: the JSON
    file (relative: in the run dir).

    Example:
        >>> PlanConfig().device, PlanConfig(device="custom", memory_gb=96, peak_tflops=400, nvlink_gb_s=300,
        ...                                 infiniband_gb_s=25, family="hopper").memory_gb
        ('H100', 96)
        >>> PlanConfig(device="B300")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.errors.RecipeConfigError: plan.device='B300' is not one of 'A100', ...
    """

    device: str = "H100"
    memory_gb: Optional[float] = None
    peak_tflops: Optional[float] = None
    nvlink_gb_s: Optional[float] = None
    infiniband_gb_s: Optional[float] = None
    family: Optional[str] = None
    compute_efficiency: Optional[float] = None
    hbm_gb_s: Optional[float] = None
    cpu_cores: Optional[int] = None
    gpus_per_node: Optional[int] = None
    nodes: Optional[int] = None
    global_batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    expert_imbalance: float = 1.0
    flash_attention: bool = True
    selective_policy: str = "matmuls"
    compile: bool = False
    float8: bool = False
    data_parallel: Optional[str] = None
    kernels: str = "eager"
    search: bool = False
    top: int = 5
    context_parallel: Optional[List[int]] = field(default_factory=lambda: [1, 2, 4, 8])  # search.CP_CHOICES
    trace: bool = True
    trace_blocks: Optional[int] = None
    trace_ranks: Optional[List[int]] = None
    materialize_rank: Optional[int] = None
    output: str = "plan.json"

    def __post_init__(self) -> None:
        from lightning_4d.planner.hardware import FAMILIES, device_names
        from lightning_4d.planner.spec import DATA_PARALLEL_MODES, KERNELS, SELECTIVE_POLICIES

        _one_of("plan.device", self.device, (*device_names(), "custom"))
        for key in ("memory_gb", "peak_tflops", "nvlink_gb_s", "infiniband_gb_s", "compute_efficiency", "hbm_gb_s"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise RecipeConfigError(f"plan.{key}={value!r} must be a number > 0.")
        if self.compute_efficiency is not None and self.compute_efficiency > 1:
            raise RecipeConfigError(f"plan.compute_efficiency={self.compute_efficiency} is a share of the peak: "
                                    f"use a number in (0, 1], e.g. 0.6.")
        if self.device == "custom":
            for key in ("memory_gb", "peak_tflops", "nvlink_gb_s", "infiniband_gb_s"):
                if getattr(self, key) is None:
                    raise RecipeConfigError(f"plan.device=custom needs plan.{key} (memory_gb, peak_tflops, nvlink_gb_s "
                                            f"and infiniband_gb_s describe the device).")
            if self.family is None and self.compute_efficiency is None:
                raise RecipeConfigError(
                    f"plan.device=custom needs plan.family ({', '.join(sorted(FAMILIES))}: the family's calibrated "
                    f"GEMM efficiency and constants) or plan.compute_efficiency (share of the peak a large GEMM "
                    f"reaches, e.g. 0.6).")
        if self.family is not None:
            _one_of("plan.family", self.family, tuple(sorted(FAMILIES)))
            if self.device != "custom":
                raise RecipeConfigError(f"plan.family={self.family} describes a custom device; plan.device={self.device} "
                                        f"has its own family. Set plan.device=custom, or drop plan.family.")
        _one_of("plan.selective_policy", self.selective_policy, SELECTIVE_POLICIES)
        _one_of("plan.data_parallel", self.data_parallel, (None, *DATA_PARALLEL_MODES))
        _one_of("plan.kernels", self.kernels, KERNELS)
        for key in ("gpus_per_node", "nodes", "global_batch_size", "seq_len", "trace_blocks", "cpu_cores"):
            _positive(f"plan.{key}", getattr(self, key), allow_none=True)
        _positive("plan.top", self.top)
        for cp in self.context_parallel or []:
            _positive("plan.context_parallel", cp)
        if not self.expert_imbalance >= 1.0:
            raise RecipeConfigError(
                f"plan.expert_imbalance={self.expert_imbalance} must be >= 1 (1 = uniform routing).")
        for r in self.trace_ranks or []:
            _non_negative("plan.trace_ranks", r)
        if self.materialize_rank is not None:
            _non_negative("plan.materialize_rank", self.materialize_rank)


@dataclass
class PlanRecipeConfig(TrainConfig):
    """The primary config of ``recipes/plan.py`` (``conf/plan.yaml``): the training config plus ``plan``.

    Example:
        >>> PlanRecipeConfig().plan.search
        False
    """

    plan: PlanConfig = field(default_factory=PlanConfig)
