"""Dry-run planner: parameter counts, memory per rank, bytes per collective and mesh axis, pipeline
bubble, step time / MFU, and a layout search — pure functions, no process group.

The layers of the planner:

- :mod:`.spec` — :class:`TransformerSpec` (from the package's model configs) and :class:`TrainSpec`;
- :mod:`.hardware` — devices by name and their families' calibrated constants, clusters, which mesh axes
  cross nodes;
- :mod:`.memory` — model states, FSDP buffers and activations (Korthikanti et al. 2022) per pp rank;
- :mod:`.comm` — bytes per collective kind and axis per step;
- :mod:`.bubble` — in-flight micro-batches and the cached replay of torch's table; the bubble's one
  formula is :func:`lightning_4d.pipeline.schedules.bubble_theory`;
- :mod:`.compute` — GEMM-shape-dependent compute time, memory-bound kernels, optimizer step;
- :mod:`.dp_modes` — states and traffic of fsdp, replicate, hsdp, zero1, zero2;
- :mod:`.roofline` — step time and MFU;
- :mod:`.calibrate` — published figures and the ratio table (``docs/planner_calibration.md``, planned through
  ``recipes/plan.py``'s path by :mod:`lightning_4d.recipes.calibration`);
- :mod:`.moe_1t` — the reference 1T MoE (``conf/model/moe_1t.yaml``) on 512 / 1024 GPUs (``docs/moe_1t_plan.md``);
- :mod:`.search` — enumerate, filter by memory, rank by time;
- :mod:`.report` — ``make_plan`` / ``format_table`` / ``write_plan``;
- :mod:`.fake_world` — one-process dry runs on torch's ``fake`` process group (traced collectives);
- :mod:`.dry_run` — the real ``parallelize_module`` of a meta model traced for one rank per pipeline
  stage on a fake group of the full world size, compared with :mod:`.comm` (``recipes/plan.py``).

Example:
    >>> from lightning_4d.planner import seed_moe_1t, TrainSpec, ClusterSpec, H200, search
    >>> best = search(seed_moe_1t(), ClusterSpec(128, 8, H200), TrainSpec(global_batch_size=1024),
    ...               schedules=("1f1b",), activation_checkpointing=("full",), sequence_parallel=(True,),
    ...               data_parallel=("fsdp",), context_parallel=(1,))[0]  # a few options: every one takes minutes
    >>> best.estimate.mfu > 0.1
    True
"""

from lightning_4d.pipeline.schedules import in_flight_microbatches
from lightning_4d.planner.bubble import replayed_bubble
from lightning_4d.planner.comm import Collective, collective_bytes, comm_per_rank, summarize
from lightning_4d.planner.hardware import (
    A100,
    CPU,
    CPU_TOY,
    DEVICES,
    FAMILIES,
    H100,
    H100_HBM2E_500W,
    H200,
    ClusterSpec,
    DeviceFamily,
    DeviceSpec,
    axes_crossing_nodes,
    custom_device,
    device_by_name,
)
from lightning_4d.planner.memory import RankMemory, memory_per_rank
from lightning_4d.planner.report import format_table, make_plan, write_plan
from lightning_4d.planner.roofline import StepEstimate, estimate_step
from lightning_4d.planner.search import Candidate, NoLayoutFits, search
from lightning_4d.planner.spec import TrainSpec, TransformerSpec, seed_moe_1t

__all__ = [
    "A100", "CPU", "CPU_TOY", "DEVICES", "FAMILIES", "H100", "H100_HBM2E_500W", "H200", "Candidate", "ClusterSpec",
    "Collective", "DeviceFamily", "DeviceSpec", "NoLayoutFits", "custom_device", "device_by_name",
    "RankMemory", "StepEstimate", "TrainSpec", "TransformerSpec", "axes_crossing_nodes",
    "collective_bytes", "comm_per_rank", "estimate_step", "format_table", "in_flight_microbatches", "make_plan",
    "memory_per_rank", "replayed_bubble", "search", "seed_moe_1t", "summarize", "write_plan",
]
