"""Fail fast before building anything: parameter counts, per-rank memory and the devices a layout needs.

Everything here is arithmetic on the config (no model is built, nothing is allocated), so a layout
meant for hundreds of GPUs is rejected in milliseconds on a laptop instead of hanging in a collective
or running out of memory.

Memory estimate (a lower bound: activations, communication buffers and fragmentation excluded)::

    dense params per rank  = dense / (tp · pp)          [ / dp  under FSDP ]
    expert params per rank = experts / (ep · pp)        [ / edp under FSDP ],  edp = dp · tp / ep
    bytes per rank         = (dense + expert params per rank) × bytes per parameter

Bytes per parameter = weights + gradients + the two AdamW moments: 16 for ``32-true`` / ``*-mixed``
(fp32 weights, fp32 gradients, fp32 moments), 8 for ``bf16-true`` / ``16-true``, 32 for ``64-true``.
For a detailed plan (activations, communication volume per axis, pipeline bubble) use the dry-run
planner ``python recipes/plan.py`` with the same overrides.

Example:
    >>> from lightning_4d.recipes.schema import LlamaModelConfig
    >>> count_params(LlamaModelConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, ffn_hidden=4)).total
    188
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from lightning_4d.recipes.schema import (
    GPT2ModelConfig,
    HFModelConfig,
    LlamaModelConfig,
    MoEModelConfig,
    ParallelConfig,
    RecipeConfigError,
    TrainConfig,
)

__all__ = [
    "DeviceInventory",
    "Layout",
    "MemoryEstimate",
    "ParamCount",
    "ResourceError",
    "bytes_per_param",
    "check_resources",
    "count_params",
    "detect_devices",
    "estimate_memory",
    "format_count",
    "resolve_layout",
]

GiB = 1024**3


class ResourceError(RuntimeError):
    """The layout cannot run on the devices that exist (or would not fit in their memory).

    Example:
        >>> isinstance(ResourceError("needs 512 GPUs"), RuntimeError)
        True
    """


def format_count(n: float) -> str:
    """``1.04T``, ``8.03B``, ``125M``, ``4.1K``.

    Example:
        >>> format_count(1_038_000_000_000), format_count(124_439_808), format_count(188)
        ('1.04T', '124M', '188')
    """
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g}{unit}"
    return f"{int(n)}"


# ---------------------------------------------------------------------------------------------- params
@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model config: ``dense`` (replicated over ep; split by tp/pp), ``expert`` (routed
    expert weights; split by ep/pp) and ``active`` (used per token: dense + ``top_k`` experts).

    Example:
        >>> ParamCount(dense=10, expert=40, active=20).total
        50
    """

    dense: int
    expert: int
    active: int

    @property
    def total(self) -> int:
        """All parameters."""
        return self.dense + self.expert

    def describe(self) -> str:
        """One line, e.g. ``1.04T parameters (8.15B dense, 1.03T in experts; 40.4B active per token)``."""
        if not self.expert:
            return f"{format_count(self.total)} parameters (dense)"
        return (f"{format_count(self.total)} parameters ({format_count(self.dense)} dense, "
                f"{format_count(self.expert)} in experts; {format_count(self.active)} active per token)")


def _llama_ffn_hidden(cfg: LlamaModelConfig) -> int:
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    hidden = int(2 * 4 * cfg.dim / 3)
    return cfg.multiple_of * -(-hidden // cfg.multiple_of)  # Llama's round-up to multiple_of


def is_moe_layer(layer_id: int, first_dense_layers: int, moe_every: int) -> bool:
    """Whether block ``layer_id`` is MoE (same rule as ``lightning_4d.models.moe``).

    Example:
        >>> [is_moe_layer(i, 1, 2) for i in range(4)]
        [False, True, False, True]
    """
    return layer_id >= first_dense_layers and (layer_id - first_dense_layers) % moe_every == 0


def count_params(model: Any) -> ParamCount:
    """Exact parameter count of a model schema, without building the model.

    Llama-style block: attention ``D·H·hd + 2·D·KV·hd + H·hd·D``, two RMSNorms ``2D``, and either a
    SwiGLU ``3·D·F`` or an MoE (router ``D·E``, experts ``3·E·D·F_e``, shared experts ``3·D·S·F_e``);
    plus embedding ``V·D``, output ``V·D`` (unless tied) and the final norm ``D``. GPT-2 likewise with
    biases, LayerNorms and learned positions. Tests check these against the real modules. A Hugging Face
    model (``model=hf``) is counted on a meta-device build of its config (:mod:`lightning_4d.recipes.hf_model`).

    Example:
        >>> count_params(MoEModelConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, num_experts=4,
        ...                             top_k=1, expert_hidden=4)).expert
        192
    """
    if isinstance(model, HFModelConfig):
        from lightning_4d.recipes.hf_model import hf_param_count

        return hf_param_count(model)
    if isinstance(model, GPT2ModelConfig):
        d, b = model.n_embd, int(model.bias)
        per_layer = 2 * (d + b * d) + (3 * d * d + b * 3 * d) + (d * d + b * d) + (4 * d * d + b * 4 * d) + (
            4 * d * d + b * d)
        n = model.vocab_size * d + model.block_size * d + model.n_layer * per_layer + (d + b * d)
        if not model.tie_embeddings:
            n += model.vocab_size * d
        return ParamCount(dense=n, expert=0, active=n)
    if not isinstance(model, LlamaModelConfig):
        raise RecipeConfigError(f"cannot count the parameters of {type(model).__name__}")
    d, h = model.dim, model.n_heads
    kv = model.n_kv_heads or h
    hd = d // h
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * d
    dense = model.vocab_size * d + d + (0 if model.tie_embeddings else model.vocab_size * d)
    expert = active_expert = 0
    ffn = 3 * d * _llama_ffn_hidden(model)
    for i in range(model.n_layers):
        dense += attn
        if isinstance(model, MoEModelConfig) and is_moe_layer(i, model.first_dense_layers, model.moe_every):
            one = 3 * d * model.expert_hidden
            dense += d * model.num_experts + model.shared_experts * one
            expert += model.num_experts * one
            active_expert += model.top_k * one
        else:
            dense += ffn
    return ParamCount(dense=dense, expert=expert, active=dense + active_expert)


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """Resolved degrees: ``world = tp·pp·dp``; experts over ``ep`` and ``edp = dp·tp/ep``.

    Example:
        >>> Layout(tp=2, pp=2, dp=2, ep=2).edp
        2
    """

    tp: int
    pp: int
    dp: int
    ep: int
    sequence_parallel: bool = True
    data_parallel: str = "fsdp"

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Data-parallel degree of the experts (``dp·tp/ep``; 0 when ep does not divide dp·tp)."""
        return (self.dp * self.tp) // self.ep if (self.dp * self.tp) % self.ep == 0 else 0

    def describe(self) -> str:
        """E.g. ``tp=8 (+SP) × pp=4 × dp=16 = 512 ranks; ep=8 (edp=16); fsdp``."""
        sp = " (+SP)" if self.sequence_parallel and self.tp > 1 else ""
        text = f"tp={self.tp}{sp} × pp={self.pp} × dp={self.dp} = {self.world} ranks"
        if self.ep > 1:
            edp = f"edp={self.edp}" if self.edp else f"invalid: ep={self.ep} does not divide dp·tp"
            text += f"; ep={self.ep} folded into dp·tp={self.dp * self.tp} ({edp})"
        return f"{text}; data_parallel={self.data_parallel}"


def resolve_layout(parallel: ParallelConfig, world: Optional[int]) -> Layout:
    """The layout for ``world`` ranks (``dp="auto"`` → ``world/(tp·pp)``; with ``world=None``, dp=1).

    Example:
        >>> resolve_layout(ParallelConfig(tp=2), 8).dp
        4
        >>> resolve_layout(ParallelConfig(tp=8, pp=4, dp=16), None).world
        512
    """
    if parallel.dp == "auto":
        dp = max(1, (world or 1) // (parallel.tp * parallel.pp))
    else:
        dp = int(parallel.dp)
    return Layout(tp=parallel.tp, pp=parallel.pp, dp=dp, ep=parallel.ep,
                  sequence_parallel=parallel.sequence_parallel, data_parallel=parallel.data_parallel)


# ---------------------------------------------------------------------------------------------- memory
def bytes_per_param(precision: str) -> int:
    """Weights + gradients + two AdamW moments, per parameter, for a Lightning precision string.

    Example:
        >>> bytes_per_param("32-true"), bytes_per_param("bf16-mixed"), bytes_per_param("bf16-true")
        (16, 16, 8)
    """
    p = str(precision)
    if p.startswith("64"):
        return 32
    if p in ("bf16-true", "16-true", "bf16", "16"):
        return 8
    return 16


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank parameters and bytes for weights + gradients + AdamW states (no activations).

    Example:
        >>> MemoryEstimate(dense_per_rank=1_000_000, expert_per_rank=0, bytes_per_param=16).bytes_per_rank
        16000000
    """

    dense_per_rank: float
    expert_per_rank: float
    bytes_per_param: int

    @property
    def params_per_rank(self) -> float:
        """Parameters held by one rank."""
        return self.dense_per_rank + self.expert_per_rank

    @property
    def bytes_per_rank(self) -> int:
        """Bytes for weights, gradients and optimizer states on one rank."""
        return int(self.params_per_rank * self.bytes_per_param)

    def describe(self) -> str:
        """E.g. ``30.3 GiB per rank (2.03B parameters: 16.0M dense + 2.01B expert, × 16 B)``."""
        return (f"{self.bytes_per_rank / GiB:.3g} GiB per rank for weights + grads + AdamW "
                f"({format_count(self.params_per_rank)} parameters: {format_count(self.dense_per_rank)} dense + "
                f"{format_count(self.expert_per_rank)} expert, × {self.bytes_per_param} B; activations not included)")


def estimate_memory(params: ParamCount, layout: Layout, precision: str = "32-true") -> MemoryEstimate:
    """Per-rank memory of the parameters and their training state (formula in the module docstring).

    Example:
        >>> est = estimate_memory(ParamCount(dense=8_000, expert=64_000, active=0),
        ...                       Layout(tp=2, pp=2, dp=2, ep=2, data_parallel="replicate"))
        >>> est.dense_per_rank, est.expert_per_rank
        (2000.0, 16000.0)
    """
    fsdp = layout.data_parallel == "fsdp"
    dense = params.dense / (layout.tp * layout.pp) / (layout.dp if fsdp else 1)
    edp = max(layout.edp, 1)
    expert = params.expert / (layout.ep * layout.pp) / (edp if fsdp else 1)
    return MemoryEstimate(dense_per_rank=dense, expert_per_rank=expert, bytes_per_param=bytes_per_param(precision))


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


def _shape_problems(model: Any, par: ParallelConfig) -> list[str]:
    """Model dimensions the layout cannot split (heads over tp, blocks over pp stages)."""
    problems: list[str] = []
    if isinstance(model, HFModelConfig):
        from lightning_4d.recipes.hf_model import hf_shape

        shape = hf_shape(model)
        heads = {f"config.json's {k}": v for k, v in shape.heads.items()}
        layers = shape.num_hidden_layers
    elif isinstance(model, GPT2ModelConfig):
        heads = {"n_head": model.n_head}
        layers = model.n_layer
    else:
        heads = {"n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads or model.n_heads}
        layers = model.n_layers
    for key, value in heads.items():
        if value % par.tp:
            key = key if key.startswith("config") else f"model.{key}"
            problems.append(f"model: {key}={value} is not divisible by parallel.tp={par.tp}; tensor "
                            f"parallelism gives every tp rank the same number of heads.")
    stages = par.pp * (par.virtual_stages or 1)
    if stages > layers:
        problems.append(f"model: {layers} blocks cannot fill pp·virtual_stages = {stages} pipeline stages.")
    return problems


def _experts(model: Any) -> tuple[Optional[int], str]:
    """Routed experts per MoE layer and the key naming them (``None``: a dense model)."""
    if isinstance(model, MoEModelConfig):
        return model.num_experts, "model.num_experts"
    if isinstance(model, HFModelConfig):
        from lightning_4d.recipes.hf_model import hf_shape

        return hf_shape(model).num_experts, "config.json's number of experts"
    return None, ""


def strategy_rule_problems(cfg: TrainConfig, world: int) -> list[str]:
    """What ``FourDStrategy`` would refuse at setup, found before any rank starts by running the same checks:
    the degrees (:meth:`~lightning_4d.config.FourDConfig.resolve`), the pipeline micro-batches against
    ``data.batch_size`` (per dp rank) and the schedule (:func:`~lightning_4d.pipeline.schedules.validate_microbatches`),
    and the vocabulary that the vocab-parallel embedding and head split over ``tp``. Pure.

    Example:
        >>> from lightning_4d.recipes.schema import SyntheticDataConfig
        >>> cfg = TrainConfig(model=LlamaModelConfig(vocab_size=255), data=SyntheticDataConfig(vocab_size=255),
        ...                   parallel=ParallelConfig(tp=2))
        >>> strategy_rule_problems(cfg, 2)  # doctest: +ELLIPSIS
        ['model: the vocabulary (255) is not divisible by parallel.tp=2: ...']
    """
    from lightning_4d.config import FourDConfig
    from lightning_4d.pipeline.schedules import validate_microbatches
    from lightning_4d.tensor_parallel.plan import check_divisible

    par = cfg.parallel
    try:
        dims = FourDConfig(tp=par.tp, pp=par.pp, ep=par.ep, dp=par.dp, sequence_parallel=par.sequence_parallel,
                           microbatches=par.microbatches, schedule=par.schedule, virtual_stages=par.virtual_stages,
                           data_parallel=par.data_parallel).resolve(world)
    except ValueError as err:
        return [f"parallel: {err}"]
    problems: list[str] = []
    if dims.pp > 1:
        try:
            validate_microbatches(par.schedule, dims.pp, dims.virtual_stages, par.microbatches, cfg.data.batch_size)
        except ValueError as err:
            problems.append(f"parallel.microbatches / data.batch_size (per dp rank): {err}")
    vocab = getattr(cfg.model, "vocab_size", None)
    if isinstance(cfg.model, HFModelConfig):
        from lightning_4d.recipes.hf_model import hf_shape

        vocab = hf_shape(cfg.model).vocab_size
    if dims.tp > 1 and isinstance(vocab, int):
        try:
            check_divisible("model", "vocab_size", vocab, dims.tp)
        except ValueError:
            padded = -(-vocab // dims.tp) * dims.tp
            problems.append(
                f"model: the vocabulary ({vocab}) is not divisible by parallel.tp={dims.tp}: the vocab-parallel embedding "
                f"and output head split it evenly over the tp ranks. Pad the vocabulary to {padded} (model.vocab_size, "
                f"or vocab_size in config.json) or choose parallel.tp among the divisors of {vocab}.")
    return problems


# ---------------------------------------------------------------------------------------------- the check
@dataclass(frozen=True)
class ResourceReport:
    """The outcome of :func:`check_resources` (when nothing is wrong).

    Example:
        >>> ResourceReport.__name__
        'ResourceReport'
    """

    params: ParamCount
    layout: Layout
    memory: MemoryEstimate
    inventory: DeviceInventory

    def describe(self) -> str:
        """Three lines: parameters, layout, memory."""
        return f"model: {self.params.describe()}\nlayout: {self.layout.describe()}\nmemory: {self.memory.describe()}"


def check_resources(cfg: TrainConfig, inventory: Optional[DeviceInventory] = None) -> ResourceReport:
    """Compare what the recipe needs with what exists; raise one clear error listing every problem.

    Checks (all pure arithmetic plus a device count): the layout's world ``tp·pp·dp`` against
    ``trainer.devices × trainer.num_nodes``; heads against ``tp`` and blocks against ``pp``; ``ep``
    against the model's experts; the devices per node
    against the GPUs (or CPU) present; the estimated memory per rank against the device memory (GPU) or
    the host RAM shared by the local ranks (CPU). Multi-node jobs are checked for this node only.

    Raises:
        ResourceError: naming the layout, the devices needed, the memory needed and what exists.

    Example:
        >>> from omegaconf import OmegaConf
        >>> from lightning_4d.recipes.schema import TrainConfig, SyntheticDataConfig
        >>> cfg = TrainConfig(model=LlamaModelConfig(), data=SyntheticDataConfig())
        >>> check_resources(cfg).layout.world
        1
    """
    inv = inventory if inventory is not None else detect_devices(cfg.trainer.accelerator)
    t, par, model = cfg.trainer, cfg.parallel, cfg.model
    devices = t.devices if t.devices != "auto" else (inv.count if inv.kind == "cuda" else 1)
    world = devices * t.num_nodes
    layout = resolve_layout(par, world)
    params = count_params(model)
    memory = estimate_memory(params, layout, str(t.precision))
    problems: list[str] = []

    if par.dp == "auto" and world % (par.tp * par.pp):
        problems.append(
            f"world: trainer.devices × trainer.num_nodes = {devices} × {t.num_nodes} = {world} ranks is not a "
            f"multiple of tp·pp = {par.tp}·{par.pp} = {par.tp * par.pp}.")
    elif layout.world != world:
        nodes = -(-layout.world // devices)
        hint = (f"trainer.devices={devices} trainer.num_nodes={nodes}" if layout.world % devices == 0
                else f"trainer.devices × trainer.num_nodes = {layout.world}")
        problems.append(
            f"world: the layout needs tp·pp·dp = {par.tp}·{par.pp}·{layout.dp} = {layout.world} ranks but the "
            f"trainer starts trainer.devices × trainer.num_nodes = {devices} × {t.num_nodes} = {world}; "
            f"use {hint} (or parallel.dp=auto).")
    problems += _shape_problems(model, par)
    if not problems:  # the strategy's own rules, by the strategy's own code (no layout error costs a launch)
        problems += strategy_rule_problems(cfg, world)
    if par.ep > 1:
        experts, key = _experts(model)
        if experts is None:
            problems.append(f"experts: parallel.ep={par.ep} needs a mixture-of-experts model "
                            f"(e.g. model=tiny_moe); model={model.name} has no experts. Set parallel.ep=1.")
        elif experts % par.ep:
            problems.append(f"experts: {key}={experts} is not divisible by "
                            f"parallel.ep={par.ep}; every ep rank must hold the same number of experts.")
        if layout.edp == 0:
            problems.append(f"experts: parallel.ep={par.ep} does not divide dp·tp = {layout.dp}·{layout.tp}.")
    if inv.kind == "cuda":
        if inv.count < devices:
            problems.append(
                f"devices: {devices} CUDA devices per node are needed (trainer.devices={devices}, "
                f"{layout.world} GPU ranks over {t.num_nodes} node(s)) but this machine has {inv.count}.")
        elif inv.memory_bytes and memory.bytes_per_rank > inv.memory_bytes:
            problems.append(
                f"memory: ~{memory.bytes_per_rank / GiB:.3g} GiB per rank is needed but a GPU here has "
                f"{inv.memory_bytes / GiB:.3g} GiB; raise dp with data_parallel=fsdp, tp, pp or ep.")
    elif inv.memory_bytes and memory.bytes_per_rank * devices > inv.memory_bytes:
        problems.append(
            f"memory: ~{memory.bytes_per_rank / GiB:.3g} GiB per rank × {devices} local ranks = "
            f"{memory.bytes_per_rank * devices / GiB:.3g} GiB is needed but this machine has "
            f"{inv.memory_bytes / GiB:.3g} GiB of RAM.")

    report = ResourceReport(params, layout, memory, inv)
    if problems:
        kind = "GPU" if inv.kind == "cuda" or t.accelerator in ("gpu", "cuda") else t.accelerator
        lines = [
            "This recipe cannot run here (checked before building anything):",
            f"  model:    {model.name}: {params.describe()}",
            f"  layout:   {par.name}: {layout.describe()}",
            f"  needs:    {layout.world} {kind} ranks ({devices} per node × {-(-layout.world // devices)} nodes), "
            f"{memory.describe()}",
            f"  trainer:  accelerator={t.accelerator} devices={devices} num_nodes={t.num_nodes} "
            f"precision={t.precision}",
            f"  machine:  {inv.describe()}",
            "  problems:",
            *(f"    - {p}" for p in problems),
            "  A per-rank plan (memory incl. activations, communication, pipeline bubble) without any device: "
            f"python recipes/plan.py model={model.name} parallel={par.name}",
            "  (skip this check with check_resources=false)",
        ]
        raise ResourceError("\n".join(lines))
    return report
