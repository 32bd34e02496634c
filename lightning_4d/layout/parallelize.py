"""Apply a :class:`~lightning_4d.plan.LayoutPlan` to a LightningModule, and check it on a copy.

Set-up runs in one direction: plan (:func:`~lightning_4d.layout.derive_plan.plan_layout`, one traced forward on the
unsharded model, nothing changed) → check (:func:`check_layout` on a reduced copy with perturbed weights, before
the real model is touched: :mod:`lightning_4d.layout.reduced_check`) → apply (:func:`apply_layout`, in TorchTitan's
order: prune to this rank's stages, expert parallelism, TP/SP, activation checkpointing, data parallelism) →
materialise (:mod:`lightning_4d.materialize.local_shards`, for a model built on the meta device).

Example:
    >>> # not run: needs a process group
    >>> record = parallelize_module(lightning_module, mesh, FourDConfig(tp=2), "32-true")  # doctest: +SKIP
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from lightning_4d._compat import registered_submodule
from lightning_4d.layout.activation_checkpoint import apply_activation_checkpointing
from lightning_4d.config import FourDConfig
from lightning_4d.context_parallel.layer_masks import LayerMasks
from lightning_4d.layout.data_parallel import apply_data_parallel, reshards_after_forward, wrap_mode
from lightning_4d.analysis.discovery import top_level_modules
from lightning_4d.core.distributed import all_reduce_coalesced, local_of
from lightning_4d.expert_parallel import apply_expert_parallel
from lightning_4d.expert_parallel.inplace import is_inplace_experts
from lightning_4d.expert_parallel.parallel import (
    apply_inplace_expert_parallel,
    expert_grad_scale,
    install_token_shard_check,
)
from lightning_4d.layout.expert_replay import check_with_experts_replayed, record_expert_layers
from lightning_4d.mesh import Axis, FourDMesh, ParallelDims
from lightning_4d.analysis.hooks import TP_PLAN, user_hook
from lightning_4d.layout.derive_plan import check_given_plan, plan_layout
from lightning_4d.plan import LayoutPlan
from lightning_4d.pipeline.checks import check_staged
from lightning_4d.layout.pipeline_glue import build_runner, check_after_tensor_parallel, install_stages, split_pipeline
from lightning_4d.pipeline.runner import PipelineRunner
from lightning_4d.tensor_parallel import apply_tensor_parallel
from lightning_4d.tensor_parallel.apply import run_user_plan_once
from lightning_4d.tensor_parallel.layouts import attach_plan
from lightning_4d.analysis.trace import example_tokens
from lightning_4d.layout.describe import LayoutRow, describe_layout
from lightning_4d.speed.compile import SPLIT_BACKWARD_SCHEDULES, apply_compile
from lightning_4d.speed.float8 import apply_plan_float8

__all__ = ["LayoutRow", "ParallelPlan", "apply_layout", "check_layout", "describe_layout", "parallelize_module",
           "plan_config", "plan_layout", "reduce_tp_partial_grads", "tp_summed_parameters"]


@dataclass
class ParallelPlan:
    """What runs on this rank once :func:`apply_layout` rewrote the model: the plan it applied, the handles of its
    blocks, the pipeline runner and what the step needs of the rewritten modules. Every decision is the plan's
    (``layout``): the properties read it.

    Example:
        >>> plan = LayoutPlan(degrees=(), blocks_path="layers", block_order=("0",), input_shape=(2, 8))
        >>> ParallelPlan(plan).loss_parallel, ParallelPlan(plan).input_shape
        (False, (2, 8))
    """

    layout: LayoutPlan  # the plan this rank applied
    blocks: list[nn.Module] = field(default_factory=list)  # this rank's blocks (activation checkpointing, DP units)
    pipeline: Optional[PipelineRunner] = None  # this rank's schedule over its stage modules (pp > 1)
    pipeline_tied: list[tuple[str, str]] = field(default_factory=list)  # first/last-stage tied pairs (pp > 1)
    expert_modules: list[str] = field(default_factory=list)  # the experts modules made expert-parallel here
    tp_partial_params: list[str] = field(default_factory=list)  # summed over tp: :func:`tp_summed_parameters`
    bias_update: bool = False  # an MoE router runs the aux-loss-free bias update after each optimizer step
    cp_masks: Optional[LayerMasks] = None  # context parallelism: each attention call's mask, read at set-up
    float8_fsdp_scales: bool = False  # FSDP2 gathers Float8 weights: their scales after each optimizer step
    # (model, DTensor parameters, tp_partial_params' parameters): found at the first step (reduce_tp_partial_grads)
    tp_grad_params: Optional[tuple[nn.Module, list, list]] = field(default=None, repr=False, compare=False)

    @property
    def blocks_path(self) -> str:
        """The plan's container of repeated blocks."""
        return self.layout.blocks_path

    @property
    def input_shape(self) -> Optional[tuple[int, ...]]:
        """The traced example's shape (inputs must have its rank)."""
        return self.layout.input_shape

    @property
    def loss_parallel(self) -> bool:
        """Whether the output stays vocabulary-sharded under tp (the loss runs under ``loss_parallel``)."""
        tpl = self.layout.tensor_parallel
        return tpl is not None and self.layout.degree("tp") > 1 and tpl.loss_parallel


def parallelize_module(
    module: nn.Module, mesh: FourDMesh, config: FourDConfig, precision: str, accumulate: int = 1,
    device: Optional[torch.device] = None, plan: Optional[LayoutPlan] = None,
) -> ParallelPlan:
    """Plan (unless ``plan`` is given) and apply the layout to ``module`` in place: :func:`plan_layout` then
    :func:`apply_layout` (what the planner's dry run and set-up simulation call; the strategy runs the two steps
    itself, with the value check between them).

    Example:
        >>> # not run: needs a process group
        >>> parallelize_module(lm, mesh, FourDConfig(), "32-true").blocks_path  # doctest: +SKIP
        'model.layers'
    """
    if plan is None:
        plan = plan_layout(module, mesh.dims, config, mesh[Axis.TP] if mesh.dims.tp > 1 else None)
    return apply_layout(module, plan, mesh, config, precision, accumulate=accumulate, device=device)


def apply_layout(module: nn.Module, plan: LayoutPlan, mesh: FourDMesh, config: Optional[FourDConfig] = None,
                 precision: str = "32-true", accumulate: int = 1, device: Optional[torch.device] = None,
                 loss_fn: Optional[Callable[..., Any]] = None, model_is_root: bool = False) -> ParallelPlan:
    """Rewrite ``module`` in place as ``plan`` says, in TorchTitan's order: prune to this rank's pipeline stages,
    then expert parallelism, TP/SP, activation checkpointing, data parallelism, and the pipeline schedule. The
    only code that changes the model; it reads every decision from the plan — the schedule, the data-parallel
    mode, activation checkpointing and the expert modules included — after checking it against the model, the
    mesh and ``config`` (:func:`check_given_plan`: options that disagree with the plan are refused, naming both).
    ``module`` may be on the meta device; ``device``: where its pipeline stages will run once materialised
    (default: where its parameters are); ``config``: the strategy's options (default: those the plan records,
    :func:`plan_config`), of which only ``microbatches`` is not the plan's; ``loss_fn``: the pipeline's loss
    (default: ``module.loss_fn``). Without pipeline parallelism data parallelism wraps each child of ``module``
    holding parameters (a LightningModule's models), or ``module`` itself with ``model_is_root`` (the model, as
    Fabric sets it up). Values are not compared here: :func:`check_layout` does that on a copy, before.

    Example:
        >>> # not run: needs a process group
        >>> apply_layout(lm, plan_layout(lm, mesh.dims, config), mesh, config, "32-true")  # doctest: +SKIP
    """
    dims = mesh.dims
    config = config if config is not None else plan_config(plan, dims)
    check_given_plan(module, plan, dims, config)
    attach_plan(module, plan)  # materialisation, checkpoints and exports read the row permutations from it
    record = ParallelPlan(plan, blocks=_blocks_of(module.get_submodule(plan.blocks_path)))
    parts = None
    if dims.pp > 1:
        parts = split_pipeline(mesh, plan, install_stages(module, plan))
        record.blocks = _blocks_of(module.get_submodule(plan.blocks_path))
    if plan.float8 != "none":  # before TP: the Float8 styles shard Float8Linear (TorchTitan's order)
        record.float8_fsdp_scales = apply_plan_float8(module, plan, dims, device)
    _apply_experts(module, mesh, record, accumulate)
    if dims.tp > 1:
        assert plan.tensor_parallel is not None
        run_user_plan_once(module, plan.tensor_parallel, mesh[Axis.TP], dims.sp)
        apply_tensor_parallel(module, mesh, plan.tensor_parallel)
        if dims.ep > 1 and user_hook(module, TP_PLAN) is not None:
            # A user's plan must give the expert layers sequence shards; the automatic plan does by construction.
            # In-place experts get the routed tokens themselves; the package's MoE layer gets them (its experts not).
            names = [n if is_inplace_experts(module.get_submodule(n)) else n.rpartition(".")[0]
                     for n in record.expert_modules]
            install_token_shard_check({n: module.get_submodule(n) for n in names}, mesh[Axis.TP].get_group())
    record.tp_partial_params = tp_summed_parameters(module, plan, dims, record.expert_modules)

    checkpointing = None if plan.activation_checkpointing == "none" else plan.activation_checkpointing
    split = dims.pp > 1 and plan.schedule in SPLIT_BACKWARD_SCHEDULES  # zbv, dualpipev: two backward passes
    # Each block compiled after TP/SP, cp, ep and checkpointing, before FSDP2 (TorchTitan's order); with tp > 1 the
    # checkpoint wraps the compiled forward instead (AOTAutograd cannot save the DTensor mesh inside a checkpoint)
    inside = plan.compile != "none" and checkpointing is not None and dims.tp > 1
    if inside:
        apply_compile(record.blocks, plan.compile, split_backward=split)
    apply_activation_checkpointing(record.blocks, checkpointing)
    if plan.compile != "none" and not inside:
        apply_compile(record.blocks, plan.compile, split_backward=split)

    experts = [module.get_submodule(name) for name in record.expert_modules]
    # With edp == 1 no rank shares an expert: experts stay out of every data-parallel wrapper.
    unwrapped_experts = {p for e in experts for p in e.parameters()} if dims.edp == 1 else None
    if experts and dims.edp > 1:
        # Experts first, over edp: their gradients are averaged only over replicas of the same experts.
        for expert in experts:
            apply_data_parallel(expert, mesh[Axis.EDP], mode=wrap_mode(plan.data_parallel, experts=True),
                                precision=precision,
                                reshard_root=reshards_after_forward(dims.pp))
    if dims.dp_cp > 1:  # dp, or dp × cp with context parallelism
        direct = [name for name, p in module.named_parameters(recurse=False)]
        if direct and not model_is_root:
            raise ValueError(
                f"{type(module).__name__} holds parameters directly ({', '.join(direct)}). Data parallelism wraps "
                f"submodules; move them into a submodule (e.g. self.model)."
            )
        # Under PP the stage modules are what the schedule calls: they are the data-parallel roots.
        roots = parts.modules if parts is not None else \
            [module] if model_is_root else [child for _, child in top_level_modules(module)]
        for root in roots:
            inner = [b for b in record.blocks if _is_within(b, root)]
            apply_data_parallel(root, mesh.data_parallel, blocks=inner, mode=wrap_mode(plan.data_parallel),
                                precision=precision, ignored_params=unwrapped_experts,
                                reshard_after_forward=reshards_after_forward(dims.pp))

    if parts is not None:
        record.pipeline = build_runner(module, mesh, plan, parts, config.microbatches, device=device,
                                       loss_fn=loss_fn)
        record.pipeline_tied = list(parts.tied)
    return record


def plan_config(plan: LayoutPlan, dims: ParallelDims) -> FourDConfig:
    """The options a plan records, as the :class:`~lightning_4d.config.FourDConfig` for ``dims`` (micro-batches:
    the schedule's default).

    Example:
        >>> plan = LayoutPlan(degrees=(("tp", 2),), blocks_path="layers", block_order=("0",), data_parallel="replicate")
        >>> plan_config(plan, ParallelDims.from_world(4, tp=2)).data_parallel
        'replicate'
    """
    return FourDConfig(
        tp=dims.tp, pp=dims.pp, ep=dims.ep, dp=dims.dp, cp=dims.cp, sequence_parallel=plan.sequence_parallel,
        schedule=plan.schedule, virtual_stages=plan.virtual_stages if dims.pp > 1 else None,
        data_parallel=plan.data_parallel, dp_shard=dims.dp_shard,
        activation_checkpointing=None if plan.activation_checkpointing == "none" else plan.activation_checkpointing,
        compile=False if plan.compile == "none" else plan.compile, float8=plan.float8 != "none",
        float8_recipe=plan.float8 if plan.float8 != "none" else "tensorwise")


def check_layout(module: nn.Module, plan: LayoutPlan, mesh: FourDMesh, accumulate: int = 1) -> None:
    """The value check of ``plan`` on ``module`` (a model with values, small enough for one rank: the set-up
    check's reduced copy, :mod:`lightning_4d.layout.reduced_check`): the unsharded forward on a tiny input is recorded,
    then the pipeline split (every stage in order, in one process) and the expert + tensor-parallel rewrite
    (MoE layers replaying the recorded calls: :mod:`lightning_4d.layout.expert_replay`) must reproduce it. ``module``
    is rewritten in place (all stages kept) and is to be thrown away. Collective over ``tp``.

    Raises:
        ValueError: naming the module whose sharded forward differs or fails.
    """
    dims = mesh.dims
    plan.check(module, dims)
    if dims.tp == 1 and dims.pp == 1:
        return
    example = example_tokens(module, dims.tp)
    args = example if isinstance(example, tuple) else (example,)
    was_training = module.training
    module.eval()
    record = record_expert_layers(module) if dims.tp > 1 else nullcontext({})
    try:
        with torch.no_grad(), record as expert_calls:
            expected = module(*args)
    finally:
        module.train(was_training)
    stages = None
    if dims.pp > 1:
        stages = install_stages(module, plan)
        check_staged(stages, example, expected)
    if dims.tp == 1:
        return
    _apply_experts(module, mesh, ParallelPlan(plan), accumulate)
    assert plan.tensor_parallel is not None
    run_user_plan_once(module, plan.tensor_parallel, mesh[Axis.TP], dims.sp)
    apply_tensor_parallel(module, mesh, plan.tensor_parallel)
    check_with_experts_replayed(module, expert_calls, mesh[Axis.TP],
                                lambda: check_after_tensor_parallel(module, stages, example, expected))


def reduce_tp_partial_grads(plan: Optional[ParallelPlan], mesh: FourDMesh, model: nn.Module) -> None:
    """Once per optimizer step, after backward (``FourDStrategy`` and the planner's dry run call it): sum over
    ``tp`` the gradients of plain parameters that saw only this rank's sequence shard
    (``plan.tp_partial_params``, :func:`tp_summed_parameters`) in one all-reduce per dtype (their local shards
    concatenated: the bytes of one all-reduce per parameter, in one call), and resolve DTensor gradients left
    ``Partial`` (sequence-parallel norm weights) once, instead of in every optimizer op. Which parameters to look at
    is found once per plan (no walk over the model each step).

    Example:
        >>> reduce_tp_partial_grads(None, None, nn.Linear(2, 2))  # no DTensor gradient, nothing to sum
    """
    dtensors, partial = _tp_grad_params(plan, model)
    for p in dtensors:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(x, Partial) for x in g.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
    grads = [local_of(p.grad) for p in partial if p.grad is not None]
    if grads:
        all_reduce_coalesced(grads, mesh[Axis.TP].get_group())


def _tp_grad_params(plan: Optional[ParallelPlan], model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(DTensor parameters, plan.tp_partial_params)`` of ``model``, found once and kept on the plan."""
    found = plan.tp_grad_params if plan is not None else None
    if found is None or found[0] is not model:
        names = set(plan.tp_partial_params) if plan is not None else set()
        named = list(model.named_parameters())
        found = (model, [p for _, p in named if isinstance(p, DTensor)], [p for n, p in named if n in names])
        if plan is not None:
            plan.tp_grad_params = found
    return found[1], found[2]


def _blocks_of(container: nn.Module) -> list[nn.Module]:
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def _apply_experts(module: nn.Module, mesh: FourDMesh, record: ParallelPlan, accumulate: int) -> None:
    """Make the plan's MoE layers expert-parallel (before TP): the model's own experts modules with 3-D weights in
    place (:mod:`~lightning_4d.expert_parallel.inplace`), Mixtral-style expert lists rewritten into the package's
    layer, the package's layer as is. The experts are the plan's (found once, when planning); those of other
    pipeline stages are not on this rank."""
    dims = mesh.dims
    plan = record.layout
    grad_scale = expert_grad_scale(dims)  # expert gradients are averaged over edp
    here = [e for e in plan.experts if _present(module, e.path)]
    inplace = apply_inplace_expert_parallel(module, mesh[Axis.EP], grad_scale=grad_scale,
                                            names=[e.path for e in here if e.kind == "in-place"])
    record.expert_modules += [spec.name for spec in inplace]
    layers = [e.layer for e in here if e.kind != "in-place"]
    if not layers:
        if dims.ep > 1 and not plan.experts:
            raise ValueError(
                f"ep={dims.ep} but {type(module).__name__} has no mixture-of-experts layer (an experts module with "
                f"3-D [E, ...] weights next to a router, a `gate` router with an `experts` list, or lightning_4d's "
                f"MoE). Use ep=1 for a dense model."
            )
        return
    stats = None if (dims.sp or dims.tp == 1) else ([("dp", mesh[Axis.DP_CP].get_group())] if dims.dp_cp > 1 else [])
    # Mixtral-style expert lists are rewritten only when their experts are spread (ep > 1): else they run as written
    apply_expert_parallel(module, mesh, grad_scale=grad_scale, stats_groups=stats,
                          aux_grad_scale=dims.dp_cp / max(accumulate, 1), layers=layers,
                          rewrite=dims.ep > 1)
    for name in layers:
        moe = module.get_submodule(name)
        record.expert_modules.append(f"{name}.experts")
        record.bias_update |= moe.router.expert_bias is not None


def tp_summed_parameters(module: nn.Module, plan: LayoutPlan, dims: ParallelDims,
                         expert_modules: Sequence[str]) -> list[str]:
    """The one list of parameters on this rank whose gradients are summed over ``tp`` once per optimizer step
    (:func:`reduce_tp_partial_grads`): weights the tensor-parallel plan replicates inside a sharded region
    (``plan.tensor_parallel.partial_params``) and, under sequence parallelism, what sees only this rank's sequence
    shard in an MoE layer — its router, shared experts and gates (every parameter of the layer but its experts),
    and the whole of an in-place experts module the plan lists but expert parallelism left as written (``ep = 1``,
    a forward its replay cannot split). ``expert_modules``: the experts modules made expert-parallel here.

    Example:
        >>> plan = LayoutPlan(degrees=(), blocks_path="l", block_order=())
        >>> tp_summed_parameters(nn.Linear(2, 2), plan, ParallelDims(world_size=1), [])
        []
    """
    names: list[str] = []
    tpl = plan.tensor_parallel
    if dims.tp > 1 and tpl is not None:
        names += [n for n in tpl.partial_params if _present(module, n.rpartition(".")[0])]
    if not dims.sp:
        return names
    taken = set(expert_modules)
    for entry in plan.experts:
        if not _present(module, entry.path):
            continue
        if entry.kind == "in-place" and entry.path not in taken:
            names += [f"{entry.path}.{n}" for n, _ in module.get_submodule(entry.path).named_parameters()]
            continue
        owned = {id(p) for p in module.get_submodule(entry.experts_path).parameters()}
        layer = module.get_submodule(entry.layer)
        names += [f"{entry.layer}.{n}" for n, p in layer.named_parameters() if id(p) not in owned]
    return list(dict.fromkeys(names))


def _present(module: nn.Module, name: str) -> bool:
    """Whether the module ``name`` is on this rank (a pipeline split removes other stages' or leaves stand-ins)."""
    found = registered_submodule(module, name)
    return found is not None and not getattr(found, "fourd_stub", False)


def _is_within(sub: nn.Module, root: nn.Module) -> bool:
    return any(m is sub for m in root.modules())
