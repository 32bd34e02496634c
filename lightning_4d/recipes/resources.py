"""Fail fast before building anything: parameter counts, per-rank memory and the devices a layout needs.

Everything here asks the owners of the facts, on the config alone (no model is built, nothing is allocated),
so a layout meant for hundreds of GPUs is rejected in milliseconds on a laptop instead of hanging in a
collective or running out of memory: the layout and its option rules are ``FourDConfig.resolve``'s
(:class:`~lightning_4d.mesh.ParallelDims`); parameter counts, the model's fit to the layout and the memory of
weights + gradients + AdamW per rank are the planner's (:class:`~lightning_4d.planner.TransformerSpec`,
:func:`~lightning_4d.planner.memory.check_layout`, :func:`~lightning_4d.planner.memory.memory_per_rank`); the
micro-batch and vocabulary rules are the pipeline's and tensor parallelism's. What is left here is the recipe's
own rule: the layout's world against ``trainer.devices × trainer.num_nodes`` and the devices and memory present.
For a detailed plan (activations, communication volume per axis, pipeline bubble) use the dry-run planner
``python recipes/plan.py`` with the same overrides.

Example:
    >>> from lightning_4d.recipes.schema import LlamaModelConfig
    >>> count_params(LlamaModelConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, ffn_hidden=4)).total
    188
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_4d.pipeline.schedules import validate_microbatches
from lightning_4d.planner import TrainSpec, TransformerSpec
from lightning_4d.planner.memory import check_layout, memory_per_rank
from lightning_4d.recipes.counts import ParamCount, format_count
from lightning_4d.recipes.schema import HFModelConfig, TrainConfig, owned
from lightning_4d.tensor_parallel.plan import check_divisible

if TYPE_CHECKING:
    from lightning_4d.mesh import ParallelDims
    from lightning_4d.recipes.schema import ModelConfig, ParallelConfig

__all__ = [
    "DeviceInventory",
    "ParamCount",
    "ResourceError",
    "ResourceReport",
    "check_resources",
    "count_params",
    "detect_devices",
    "format_count",
    "model_spec",
    "states_bytes_per_rank",
]

GiB = 1024**3


class ResourceError(RuntimeError):
    """The layout cannot run on the devices that exist (or would not fit in their memory).

    Example:
        >>> isinstance(ResourceError("needs 512 GPUs"), RuntimeError)
        True
    """


def model_spec(model: ModelConfig) -> Optional["TransformerSpec"]:
    """The planner's :class:`~lightning_4d.planner.TransformerSpec` of a model schema (``None`` for a Hugging
    Face config the planner cannot describe; see :func:`~lightning_4d.recipes.hf_model.hf_spec`).

    Example:
        >>> from lightning_4d.recipes.schema import GPT2ModelConfig
        >>> model_spec(GPT2ModelConfig(n_layer=2)).layers
        2
    """
    if isinstance(model, HFModelConfig):
        from lightning_4d.recipes.hf_model import hf_spec

        return hf_spec(model)
    return TransformerSpec.from_config(owned("model", model), name=model.name)


def count_params(model: ModelConfig) -> ParamCount:
    """Exact parameter count of a model schema, without building the model: the planner's count
    (:meth:`~lightning_4d.planner.TransformerSpec.components`, checked against the real modules), or for
    ``model=hf`` the model's own on a meta-device build (:func:`~lightning_4d.recipes.hf_model.hf_param_count`).

    Example:
        >>> from lightning_4d.recipes.schema import MoEModelConfig
        >>> count_params(MoEModelConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, num_experts=4,
        ...                             top_k=1, expert_hidden=4)).expert
        192
    """
    if isinstance(model, HFModelConfig):
        from lightning_4d.recipes.hf_model import hf_param_count

        return hf_param_count(model)
    spec = model_spec(model)
    expert = spec.components()["experts"]
    return ParamCount(dense=spec.total_params() - expert, expert=expert, active=spec.active_params_per_token())


def states_bytes_per_rank(spec: "TransformerSpec", dims: "ParallelDims", schedule: str = "1f1b",
                          data_parallel: str = "fsdp") -> float:
    """Bytes of weights + gradients + AdamW states on the busiest rank, from the planner's memory model
    (:func:`~lightning_4d.planner.memory.memory_per_rank`: fp32 master weights, gradients and moments,
    sharded by the layout; activations and buffers excluded).

    Example:
        >>> from lightning_4d.mesh import ParallelDims
        >>> from lightning_4d.planner import TransformerSpec
        >>> states_bytes_per_rank(TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, ffn_hidden=4),
        ...                       ParallelDims(1))
        3008.0
    """
    m = dims.pp * dims.virtual_stages if dims.pp > 1 else 1  # states do not depend on the batch
    train = TrainSpec(global_batch_size=dims.dp * m, schedule=schedule, data_parallel=data_parallel)
    return max(r.params + r.grads + r.optimizer for r in memory_per_rank(spec, dims, train))


# ---------------------------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class DeviceInventory:
    """What this machine has: ``kind`` (``"cuda"``/``"cpu"``), ``count`` (GPUs; CPU cores for cpu)
    and ``memory_bytes`` (per GPU, the smallest; host RAM for cpu).

    Example:
        >>> DeviceInventory("cpu", 2, 16 * GiB).describe()
        '0 CUDA devices; 2 CPU cores, 16 GiB RAM'
    """
    kind: str
    count: int
    memory_bytes: int
    cuda_count: int = 0
    host_memory_bytes: int = 0

    def describe(self) -> str:
        """One line about the machine."""
        if self.kind == "cuda":
            return f"{self.count} CUDA devices of {self.memory_bytes / GiB:.3g} GiB"
        return f"{self.cuda_count} CUDA devices; {self.count} CPU cores, {self.memory_bytes / GiB:.3g} GiB RAM"


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def detect_devices(accelerator: str) -> DeviceInventory:
    """Count the devices of ``accelerator`` here without initialising them (``"auto"``: CUDA if any).

    Example:
        >>> detect_devices("cpu").kind
        'cpu'
    """
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    host = _host_memory()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda > 0):
        mem = min((torch.cuda.get_device_properties(i).total_memory for i in range(cuda)), default=0)
        return DeviceInventory("cuda", cuda, int(mem), cuda, host)
    return DeviceInventory("cpu", os.cpu_count() or 1, host, cuda, host)


# ---------------------------------------------------------------------------------------------- the check
def _layout_problems(cfg: TrainConfig, dims: "ParallelDims", spec: Optional["TransformerSpec"]) -> list[str]:
    """What ``FourDStrategy`` would refuse at setup, by the owners' own checks: the model against the layout
    (heads over tp, experts over ep, blocks over the stages), the micro-batches against ``data.batch_size``
    (per dp rank) and the schedule, the vocabulary split over tp."""

    par, problems = cfg.parallel, []
    if spec is not None:
        try:
            check_layout(spec, dims)
        except ValueError as err:
            problems.append(f"model {cfg.model.name}: {err}")
    if dims.pp > 1:
        try:
            validate_microbatches(par.schedule, dims.pp, dims.virtual_stages, par.microbatches, cfg.data.batch_size)
        except ValueError as err:
            problems.append(f"parallel.microbatches / data.batch_size (per dp rank): {err}")
    if spec is not None and dims.tp > 1:
        try:
            check_divisible("model", "vocab_size", spec.vocab_size, dims.tp)
        except ValueError:
            padded = -(-spec.vocab_size // dims.tp) * dims.tp
            problems.append(
                f"model: the vocabulary ({spec.vocab_size}) is not divisible by parallel.tp={dims.tp}: the "
                f"vocab-parallel embedding and output head split it evenly over the tp ranks. Pad the vocabulary to "
                f"{padded} (model.vocab_size, or vocab_size in config.json) or choose parallel.tp among the "
                f"divisors of {spec.vocab_size}.")
    return problems


def _describe_layout(par: ParallelConfig, dims: Optional["ParallelDims"]) -> str:
    """E.g. ``tp=8 (+SP) × pp=4 × dp=16 = 512 ranks; ep=8 folded into dp·tp=128 (edp=16); data_parallel=fsdp``."""
    if dims is None:
        return f"tp={par.tp} × pp={par.pp} × dp={par.dp}; ep={par.ep}; data_parallel={par.data_parallel}"
    text = f"tp={dims.tp}{' (+SP)' if dims.sp else ''} × pp={dims.pp} × dp={dims.dp} = {dims.world_size} ranks"
    if dims.ep > 1:
        text += f"; ep={dims.ep} folded into dp·tp={dims.dp * dims.tp} (edp={dims.edp})"
    return f"{text}; data_parallel={par.data_parallel}"


@dataclass(frozen=True)
class ResourceReport:
    """The outcome of :func:`check_resources` (when nothing is wrong): counts, resolved layout, the planner's
    weights + grads + AdamW bytes per rank (``None``: not modelled) and the machine.

    Example:
        >>> ResourceReport.__name__
        'ResourceReport'
    """
    params: ParamCount
    dims: "ParallelDims"
    states_bytes: Optional[float]
    inventory: DeviceInventory
    parallel: Optional[ParallelConfig] = None

    def describe(self) -> str:
        """Three lines: parameters, layout, memory."""
        return (f"model: {self.params.describe()}\nlayout: {_describe_layout(self.parallel, self.dims)}\n"
                f"memory: {_describe_memory(self.states_bytes)}")


def _describe_memory(states: Optional[float]) -> str:
    if states is None:
        return "not estimated (the planner has no model of this Hugging Face config)"
    return (f"{states / GiB:.3g} GiB per rank for weights + grads + AdamW (the planner's memory model, busiest "
            f"rank; activations not included)")


def check_resources(cfg: TrainConfig, inventory: Optional[DeviceInventory] = None) -> ResourceReport:
    """Compare what the recipe needs with what exists; raise one clear error listing every problem.

    Checks (all pure arithmetic plus a device count): the layout (``FourDConfig.resolve``) and its world
    ``tp·pp·dp`` against ``trainer.devices × trainer.num_nodes``; the model and batch against the layout
    (:func:`_layout_problems`); the devices per node against the GPUs (or CPU) present; the planner's memory per
    rank against the device memory (GPU) or the host RAM shared by the local ranks (CPU). Multi-node jobs are
    checked for this node only.

    Raises:
        ResourceError: naming the layout, the devices needed, the memory needed and what exists.

    Example:
        >>> from lightning_4d.recipes.schema import LlamaModelConfig, SyntheticDataConfig
        >>> cfg = TrainConfig(model=LlamaModelConfig(vocab_size=256, dim=64, n_layers=2), data=SyntheticDataConfig())
        >>> check_resources(cfg).dims.world_size
        1
    """
    inv = inventory if inventory is not None else detect_devices(cfg.trainer.accelerator)
    t, par, model = cfg.trainer, cfg.parallel, cfg.model
    devices = t.devices if t.devices != "auto" else (inv.count if inv.kind == "cuda" else 1)
    world = devices * t.num_nodes
    wanted = world if par.dp == "auto" else par.tp * par.pp * int(par.dp)
    problems: list[str] = []
    try:
        dims: Optional[ParallelDims] = owned("parallel", par).resolve(wanted)
    except ValueError as err:
        dims = None
        problems.append(f"parallel (world: trainer.devices × trainer.num_nodes = {devices} × {t.num_nodes} = "
                        f"{world} ranks): {err}")
    if dims is not None and dims.world_size != world:
        hint = (f"trainer.devices={devices} trainer.num_nodes={-(-wanted // devices)}" if wanted % devices == 0
                else f"trainer.devices × trainer.num_nodes = {wanted}")
        problems.append(
            f"world: the layout needs tp·pp·dp = {par.tp}·{par.pp}·{dims.dp} = {wanted} ranks but the trainer starts "
            f"trainer.devices × trainer.num_nodes = {devices} × {t.num_nodes} = {world}; use {hint} (or "
            f"parallel.dp=auto).")
    params = count_params(model)
    spec = model_spec(model)
    states = None
    if dims is not None:
        problems += _layout_problems(cfg, dims, spec)
        try:
            states = states_bytes_per_rank(spec, dims, par.schedule, par.data_parallel) if spec else None
        except ValueError:  # the model does not fit the layout: named above
            pass
    if inv.kind == "cuda" and inv.count < devices:
        problems.append(f"devices: {devices} CUDA devices per node are needed (trainer.devices={devices}, {wanted} GPU "
                        f"ranks over {t.num_nodes} node(s)) but this machine has {inv.count}.")
    elif inv.kind == "cuda" and states and inv.memory_bytes and states > inv.memory_bytes:
        problems.append(f"memory: ~{states / GiB:.3g} GiB per rank is needed but a GPU here has "
                        f"{inv.memory_bytes / GiB:.3g} GiB; raise dp with data_parallel=fsdp, tp, pp or ep.")
    elif inv.kind != "cuda" and states and inv.memory_bytes and states * devices > inv.memory_bytes:
        problems.append(f"memory: ~{states / GiB:.3g} GiB per rank × {devices} local ranks = "
                        f"{states * devices / GiB:.3g} GiB is needed but this machine has "
                        f"{inv.memory_bytes / GiB:.3g} GiB of RAM.")
    if problems:
        kind = "GPU" if inv.kind == "cuda" or t.accelerator in ("gpu", "cuda") else t.accelerator
        raise ResourceError("\n".join([
            "This recipe cannot run here (checked before building anything):",
            f"  model:    {model.name}: {params.describe()}",
            f"  layout:   {par.name}: {_describe_layout(par, dims)}",
            f"  needs:    {wanted} {kind} ranks ({devices} per node × {-(-wanted // devices)} nodes), "
            f"{_describe_memory(states)}",
            f"  trainer:  accelerator={t.accelerator} devices={devices} num_nodes={t.num_nodes} "
            f"precision={t.precision}",
            f"  machine:  {inv.describe()}",
            "  problems:",
            *(f"    - {p}" for p in problems),
            "  A per-rank plan (memory incl. activations, communication, pipeline bubble) without any device: "
            f"python recipes/plan.py model={model.name} parallel={par.name}",
            "  (skip this check with check_resources=false)",
        ]))
    return ResourceReport(params, dims, states, inv, par)
