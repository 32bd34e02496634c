"""Set a model up for the mesh, in one order for every API: plan → reduced check → apply → materialise.

Both strategies call :func:`set_up_model`: the Trainer's ``FourDStrategy`` (:mod:`lightning_4d.strategy`) on the
LightningModule, the Fabric one (:mod:`lightning_4d.fabric`) on the user's ``nn.Module``. What differs between the
two is passed in (the precision's module conversion, the gradient-accumulation factor, the pipeline's loss).

1. **Plan**: one traced forward on the unsharded model (:func:`~lightning_4d.layout.derive_plan.plan_layout`), or
   the given plan checked against it; with context parallelism the model's attention checked first
   (:func:`check_cp_attention`).
2. **Check**: the plan applied to a reduced copy with perturbed weights, for every model, before the real one is
   touched (:func:`~lightning_4d.layout.reduced_check.check_reduced_model`, within :func:`check_budget`); its memory
   is gone before this rank's shards exist.
3. **Apply** (:func:`~lightning_4d.layout.parallelize.apply_layout`): prune to this rank's stages, EP, TP/SP,
   activation checkpointing, data parallelism, the pipeline schedule.
4. **Materialise** (:func:`~lightning_4d.materialize.local_shards.materialize_local_shards`): a model built on the
   meta device gets only this rank's shards, initialised piece by piece, so no rank ever holds the whole model; a
   model built for real is (optionally) synchronised from rank 0 in 64 MB buckets before the rewrite.

Example:
    >>> # not run: needs a process group
    >>> model, done = set_up_model(model, mesh, FourDConfig(tp=2), device=torch.device("cpu"))  # doctest: +SKIP
    >>> done.plan.summary()  # doctest: +SKIP
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_4d import _compat
from lightning_4d.analysis.trace import example_tokens
from lightning_4d.config import FourDConfig
from lightning_4d.context_parallel.algorithm import choose_algorithm
from lightning_4d.context_parallel.check import ModelInfo, check_context_parallel, example_length
from lightning_4d.context_parallel.refusals import check_unread_masks
from lightning_4d.core.distributed import broadcast_module_state, is_on_meta
from lightning_4d.core.precision import exact_fp32_matmul
from lightning_4d.layout.derive_plan import check_given_plan
from lightning_4d.layout.parallelize import ParallelPlan, apply_layout, describe_layout, plan_layout
from lightning_4d.layout.reduced_check import (
    CHECK_FLOOR_BYTES, check_budget_bytes, check_reduced_model, perturbed_copy, plan_share_bytes,
)
from lightning_4d.materialize.local_shards import MaterializeReport, materialize_local_shards, meta_skeleton
from lightning_4d.mesh import Axis, FourDMesh
from lightning_4d.plan import LayoutPlan, load_plan

__all__ = ["ModelSetUp", "check_budget", "check_cp_attention", "parameter_names", "rebind_optimizer",
           "release_freed_memory", "set_up_model"]

log = logging.getLogger(__name__)


@dataclass
class ModelSetUp:
    """What :func:`set_up_model` did: the applied plan and its record, and what the strategies report.

    Example:
        >>> plan = LayoutPlan(degrees=(), blocks_path="layers", block_order=("0",))
        >>> ModelSetUp(record=ParallelPlan(plan), plan=plan).parameter_counts
        (0, 0)
    """

    record: ParallelPlan  # what was applied (the pipeline runner, the tp-partial parameters, ...)
    plan: LayoutPlan  # the layout plan applied (save it: ``.save(path)``)
    cp_info: Optional[ModelInfo] = None  # cp > 1: what the attention check learnt of the model
    materialize_report: Optional[MaterializeReport] = None  # set when the model was built on meta
    parameter_counts: tuple[int, int] = (0, 0)  # whole model: (total, trainable)
    module_parameter_counts: dict[str, int] = field(default_factory=dict)  # whole-model parameters per submodule


def set_up_model(model: nn.Module, mesh: FourDMesh, config: FourDConfig, *, device: torch.device,
                 precision: str = "32-true", convert_module: Callable[[nn.Module], nn.Module] = lambda m: m,
                 accumulate: int = 1, loss_fn: Optional[Callable[..., Any]] = None, model_is_root: bool = False
                 ) -> tuple[nn.Module, ModelSetUp]:
    """Rewrite ``model`` for ``mesh`` in the module doc's order; returns the model (``convert_module``'s result,
    rewritten in place) and what was done. ``precision``: Lightning's precision string (FSDP2's policy);
    ``accumulate``: micro-steps per optimizer step (the check's and the expert losses' scaling); ``loss_fn``: the
    pipeline's loss (default: ``model.loss_fn``); ``model_is_root``: ``model`` is the model itself, not a
    LightningModule holding it (data parallelism wraps it whole: :func:`~lightning_4d.layout.parallelize.
    apply_layout`). A model built for real is moved to ``device`` first; the value checks run in full fp32 (TF32
    off, the user's choice restored). Collective over the world; every refusal comes before the first collective of
    the rewrite.

    Example:
        >>> # not run: needs a process group
        >>> model, done = set_up_model(model, mesh, config, device=torch.device("cpu"))  # doctest: +SKIP
    """
    with exact_fp32_matmul():  # the set-up's value checks in full fp32 (TF32 off), the user's choice restored
        return _set_up(model, mesh, config, device, precision, convert_module, accumulate, loss_fn, model_is_root)


def _set_up(model: nn.Module, mesh: FourDMesh, config: FourDConfig, device: torch.device, precision: str,
            convert_module: Callable[[nn.Module], nn.Module], accumulate: int, loss_fn: Optional[Callable[..., Any]],
            model_is_root: bool) -> tuple[nn.Module, ModelSetUp]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    meta = is_on_meta(model)
    if not meta:  # on the device before any collective sees it (NCCL refuses host tensors)
        model.to(device)
    # The unsharded model on meta (no memory): initialisation of a meta-built model and the set-up check.
    skeleton = meta_skeleton(model)
    buffers = None if meta else {n: b.detach().clone() for n, b in model.named_buffers()}
    if not meta and config.sync_module_states and mesh.dims.world_size > 1:
        broadcast_module_state(model, src=0)
    model = convert_module(model)
    params = list(model.parameters())  # the whole model, each tied weight once
    counts = (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))
    module_counts = {name: sum(p.numel() for p in sub.parameters()) for name, sub in model.named_modules() if name}
    dims = mesh.dims
    # cp > 1: on the whole model, refuse attention that cannot be split, naming the module
    cp_info = check_cp_attention(model, mesh, device, meta, skeleton, config.reduced_check_budget) \
        if dims.cp > 1 else None
    # Plan (one traced forward on the unsharded model, or the given plan checked against it) -> check (the plan
    # applied to a reduced copy with perturbed weights, for every model, before the real one is touched: its
    # memory is gone before this rank's shards exist) -> apply -> materialise.
    tp_mesh = mesh[Axis.TP] if dims.tp > 1 else None
    heads = cp_info.heads if cp_info is not None else None
    plan = load_plan(config.plan) if config.plan is not None else \
        plan_layout(model, dims, config, tp_mesh, attention_heads=heads)
    check_given_plan(model, plan, dims, config)  # a given plan: options that disagree are refused
    if plan.cp_algorithm == "ulysses" and heads is not None:  # a given plan: the heads must divide
        choose_algorithm("ulysses", heads, dims.cp, dims.tp)
    if rank == 0:
        log.info("lightning_4d: %s", plan.summary())
    check_reduced_model(skeleton, plan, mesh, accumulate=accumulate, device=device, buffers=buffers,
                        budget_bytes=check_budget(config, skeleton, plan, mesh, meta))
    del buffers
    gc.collect()  # the reduced copy's rewrite leaves reference cycles (hooks, closures) holding its tensors
    release_freed_memory(device)  # the reduced copy's memory, before the shards are allocated
    cp_masks = cp_info.layer_masks(model) if cp_info is not None else None  # before pruning to this rank's stages
    record = apply_layout(model, plan, mesh, config, precision, accumulate=accumulate, device=device,
                          loss_fn=loss_fn, model_is_root=model_is_root)
    record.cp_masks = cp_masks
    done = ModelSetUp(record=record, plan=plan, cp_info=cp_info, parameter_counts=counts,
                      module_parameter_counts=module_counts)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("lightning_4d: rank %d layout:\n  %s", rank, "\n  ".join(map(str, describe_layout(model))))
    if meta:
        start = time.perf_counter()
        report = materialize_local_shards(skeleton, model, device, sync_module_states=config.sync_module_states,
                                          source_names=plan.source_names())
        del skeleton
        gc.collect()
        release_freed_memory(device)  # the freed full tensors of the initialisation
        done.materialize_report = report
        log.info("lightning_4d: materialised this rank's shards (%.1f MB) in %.1f s, %d of %d initialiser calls "
                 "replayed piece by piece (scratch %.1f MB)%s", report.local_bytes / 2**20,
                 time.perf_counter() - start, report.calls - len(report.whole_calls), report.calls,
                 report.scratch_bytes / 2**20,
                 "; random states differed: rank 0's seed was used" if report.broadcast else "")
        if report.whole_calls and rank == 0:
            log.warning("lightning_4d: %d initialiser call(s) need tensor values and ran on whole tensors "
                        "(largest %s: %.1f MB in full): %s", len(report.whole_calls), report.largest_call,
                        report.largest_call_bytes / 2**20, "; ".join(report.whole_calls[:8]))
    return model, done


def release_freed_memory(device: torch.device) -> None:
    """Give back memory the set-up freed: the C heap's to the OS on CPU (``malloc_trim``), the caching allocator's
    unused blocks on CUDA (``torch.cuda.empty_cache()``: they would otherwise stay reserved for this process, unusable
    by NCCL and fragmenting the training's allocations).

    Example:
        >>> release_freed_memory(torch.device("cpu"))
    """
    if device.type == "cpu":
        _compat.release_freed_host_memory()
    elif device.type == "cuda":
        torch.cuda.empty_cache()


def check_cp_attention(model: nn.Module, mesh: FourDMesh, device: torch.device, meta: bool, skeleton: nn.Module,
                       budget: Optional[float] = None) -> ModelInfo:
    """:func:`~lightning_4d.context_parallel.check.check_context_parallel` on a tiny example: with values (each
    attention call's mask read, a collective over the cp group) on the model built for real, or for a meta-built one
    on a perturbed copy of it (``skeleton``: the unsharded model on meta) when the copy fits the reduced check's
    ``budget`` (else declared and traced only, :func:`~lightning_4d.context_parallel.refusals.check_unread_masks`).

    Example:
        >>> # not run: needs a process group
        >>> check_cp_attention(model, mesh, torch.device("cpu"), False, skeleton).positions  # doctest: +SKIP
        True
    """
    dims = mesh.dims
    length = example_length(model, dims.cp, dims.tp if dims.sp else 1)
    group, rank = mesh[Axis.CP].get_group(), mesh.rank(Axis.CP)
    checked = model
    if meta:
        tokens = example_tokens(model, seq=length).to("meta")  # (2, T)
        with _compat.meta_scalar_mode():
            info = check_context_parallel(model, tokens, group, dims.cp, rank, values=False)
        tensors = {id(t): t for t in [*skeleton.parameters(), *skeleton.buffers()]}.values()
        need = float(sum(t.numel() * t.element_size() for t in tensors))
        if need > (CHECK_FLOOR_BYTES if budget is None else budget):
            check_unread_masks(model, need, budget)
            return info
        checked = perturbed_copy(skeleton, device)
    tokens = example_tokens(checked, seq=length).to(device)  # (2, T)
    return check_context_parallel(checked, tokens, group, dims.cp, rank, values=True)


def check_budget(config: FourDConfig, skeleton: nn.Module, plan: LayoutPlan, mesh: FourDMesh, meta: bool) -> float:
    """Bytes the reduced check may hold, the same on every rank: ``config.reduced_check_budget``, else
    :func:`~lightning_4d.layout.reduced_check.check_budget_bytes` — for a meta-built model the largest rank's share
    (:func:`~lightning_4d.layout.reduced_check.plan_share_bytes`, from the plan) plus the largest tensor, for one
    built for real the whole model (every rank held it).

    Example:
        >>> # not run: needs a process group (a mesh)
        >>> check_budget(FourDConfig(reduced_check_budget=0), skeleton, plan, mesh, meta=True)  # doctest: +SKIP
        0.0
    """
    if config.reduced_check_budget is not None:
        return float(config.reduced_check_budget)
    tensors = {id(t): t for t in [*skeleton.parameters(), *skeleton.buffers()]}.values()
    sizes = [t.numel() * t.element_size() for t in tensors]
    if not meta:
        return check_budget_bytes(float(sum(sizes)), 0.0)
    return check_budget_bytes(plan_share_bytes(skeleton, plan, mesh.dims), float(max(sizes, default=0)))


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of ``model`` by the parameter's ``id`` (a tied weight has several): taken before
    the set-up, for :func:`rebind_optimizer`.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> parameter_names(lin)[id(lin.weight)]
        ['weight']
    """
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, list[str]], model: nn.Module) -> None:
    """Point ``optimizer``, built on the model before the set-up, at the parameters the set-up left on this rank, by
    name (``names``: :func:`parameter_names` of the model before): the rewrite replaces parameters (DTensor shards,
    materialised meta tensors) and prunes the other pipeline stages'. Each param group keeps its options and gets
    this rank's parameters of its names (none where all live on another stage); a weight tied across pipeline stages
    gets this rank's copy. Pure (no collective).

    Raises:
        ValueError: the optimizer has already stepped (its state would belong to the old tensors), holds a tensor
            that is not the model's, or the rewrite made trainable parameters under new names (experts stacked by the
            expert-parallel rewrite) that no group can be matched to: create the optimizer after the set-up.

    Example:
        >>> old = nn.Linear(2, 2); opt = torch.optim.SGD(old.parameters(), lr=0.1)
        >>> names, new = parameter_names(old), nn.Linear(2, 2)
        >>> rebind_optimizer(opt, names, new)
        >>> opt.param_groups[0]["params"][0] is new.weight
        True
    """
    fix = ("Create the optimizer after the set-up, from the set-up model's parameters: `model = fabric.setup(model)`, "
           "then `optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`.")
    if any(optimizer.state.values()):
        raise ValueError(f"{type(optimizer).__name__} has state (it has stepped) but the set-up replaces the model's "
                         f"parameters, and the state would stay with the old ones. {fix}")
    after = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        params: dict[int, nn.Parameter] = {}
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"{type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that is not a "
                                 f"parameter of {type(model).__name__}, so it cannot follow the set-up's rewrite. "
                                 f"{fix}")
            for name in names[id(p)]:
                if name in after:
                    params.setdefault(id(after[name]), after[name])
        group["params"] = list(params.values())
    known = {name for listed in names.values() for name in listed}
    new = sorted(n for n, p in after.items() if p.requires_grad and n not in known)
    if new:
        raise ValueError(f"the set-up rewrote parameters under new names ({', '.join(new[:4])}"
                         f"{' …' if len(new) > 4 else ''}: experts stacked for expert parallelism) that "
                         f"{type(optimizer).__name__}, built before it, does not hold. {fix}")
