"""Apply the layout to a LightningModule: pipeline split, TP/SP, EP, activation checkpointing, DP.

The order follows TorchTitan: split into stages first (on full tensors), then tensor and expert
parallelism on each stage, then data parallelism around everything.

Example:
    >>> plan = parallelize_module(lightning_module, mesh, FourDConfig(tp=2), "32-true")  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_4d._compat import registered_submodule
from lightning_4d.activation_checkpoint import apply_activation_checkpointing
from lightning_4d.config import FourDConfig
from lightning_4d.data_parallel import apply_data_parallel
from lightning_4d.discovery import find_blocks, top_level_modules
from lightning_4d.mesh import FourDMesh
from lightning_4d.trace import example_tokens, trace_model

__all__ = ["ParallelPlan", "parallelize_module"]


@dataclass
class ParallelPlan:
    """What was applied to the model; the strategy and the mixin read it.

    Example:
        >>> ParallelPlan(blocks_path="layers").loss_parallel
        False
    """

    blocks_path: str = ""
    blocks: list[nn.Module] = field(default_factory=list)
    loss_parallel: bool = False
    tp_modules: list[str] = field(default_factory=list)
    pipeline: Optional[Any] = None
    expert_modules: list[str] = field(default_factory=list)
    tp_partial_params: list[str] = field(default_factory=list)
    bias_update: bool = False
    pipeline_tied: list[tuple[str, str]] = field(default_factory=list)


def _hook(module: nn.Module, name: str) -> Any:
    fn = getattr(module, name, None)
    return fn if callable(fn) else None


def parallelize_module(
    module: nn.Module, mesh: FourDMesh, config: FourDConfig, precision: str, accumulate: int = 1
) -> ParallelPlan:
    """Rewrite ``module`` (a LightningModule, usually a ``FourDModule``) in place for ``mesh``.

    Order: trace one forward of the full model on a tiny input → pipeline split decided and checked
    (full model) → expert parallel → TP/SP on the full model, checked against the traced output →
    pipeline pruning → activation checkpointing → data parallel → pipeline schedule.

    Example:
        >>> parallelize_module(lm, mesh, FourDConfig(), "32-true").blocks_path  # doctest: +SKIP
        'model.layers'
    """
    dims = mesh.dims
    path_hook = _hook(module, "fourd_blocks_path")
    blocks_path, container = find_blocks(module, path_hook() if path_hook else None)
    plan = ParallelPlan(blocks_path=blocks_path, blocks=_blocks_of(container))

    trace, example = None, None
    if dims.tp > 1 or dims.pp > 1:
        example = example_tokens(module, dims.tp)
        trace = trace_model(module, blocks_path, example)

    split = None
    if dims.pp > 1:
        from lightning_4d.pipeline_glue import prepare_pipeline

        split = prepare_pipeline(module, mesh, config, trace, example)

    _apply_experts(module, mesh, plan, accumulate)

    if dims.tp > 1:
        from lightning_4d.tensor_parallel import apply_tensor_parallel, plan_tensor_parallel

        apply_tensor_parallel(module, mesh, plan, plan_tensor_parallel(module, mesh, trace))
        if not plan.expert_modules:
            _check_tensor_parallel(module, split, example, trace.output)

    parts = None
    if dims.pp > 1:
        from lightning_4d.pipeline_glue import split_pipeline

        parts = split_pipeline(module, mesh, config, split)
        plan.blocks = _blocks_of(module.get_submodule(blocks_path))
        kept = [n for n in plan.expert_modules if registered_submodule(module, n) is not None]
        plan.expert_modules = kept
        plan.tp_partial_params = [n for n in plan.tp_partial_params
                                  if registered_submodule(module, n.rpartition(".")[0]) is not None]

    apply_activation_checkpointing(plan.blocks, config.activation_checkpointing)

    experts = [module.get_submodule(name) for name in plan.expert_modules]
    # With edp == 1 no rank shares an expert: experts stay out of every data-parallel wrapper.
    unwrapped_experts = {p for e in experts for p in e.parameters()} if dims.edp == 1 else None
    if experts and dims.edp > 1:
        # Experts first, over edp: their gradients are averaged only over replicas of the same experts.
        for expert in experts:
            apply_data_parallel(expert, mesh["edp"], mode=config.data_parallel, precision=precision,
                                reshard_root=parts is None)
    if dims.dp > 1:
        direct = [name for name, p in module.named_parameters(recurse=False)]
        if direct:
            raise ValueError(
                f"{type(module).__name__} holds parameters directly ({', '.join(direct)}). Data parallelism wraps "
                f"submodules; move them into a submodule (e.g. self.model)."
            )
        # Under PP the stage modules are what the schedule calls: they are the data-parallel roots.
        roots = parts.modules if parts is not None else [child for _, child in top_level_modules(module)]
        for root in roots:
            inner = [b for b in plan.blocks if _is_within(b, root)]
            apply_data_parallel(root, mesh["dp"], blocks=inner, mode=config.data_parallel, precision=precision,
                                ignored_params=unwrapped_experts, reshard_after_forward=parts is None)

    if parts is not None:
        from lightning_4d.pipeline_glue import build_runner

        plan.pipeline = build_runner(module, mesh, config, parts)
        plan.pipeline_tied = list(parts.tied)
    return plan


def _check_tensor_parallel(module: nn.Module, split: Any, example: Any, expected: Any) -> None:
    """Run the sharded model on the traced input and compare with the unsharded output (every rank, same
    input). A rewrite that changes the forward fails here, loudly, instead of training on."""
    from lightning_4d.distributed import to_full
    from lightning_4d.pipeline.staged import StagedForward, check_staged

    if any(p.is_meta for p in module.parameters()):
        return  # a dry run on the meta device: no values to compare
    if isinstance(split, StagedForward):
        try:
            check_staged(split, example, expected, rtol=_rtol(expected))
        except ValueError as err:
            raise ValueError(f"With tensor parallelism: {err}") from err
        return
    if split is not None:
        return  # user pipeline hooks: checked by their own sequential check before sharding
    was_training = module.training
    module.eval()
    names = {id(m): n for n, m in module.named_modules()}
    stack: list[str] = []
    def enter(mod: nn.Module, _args: Any) -> None:
        stack.append(names.get(id(mod), type(mod).__name__))

    def leave(_mod: nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with torch.no_grad():
            got = to_full(module(*(example if isinstance(example, tuple) else (example,))))
    except Exception as err:  # noqa: BLE001 - reported with the hint
        failed = [n for n in stack if n]
        where = failed[-1] if failed else type(module).__name__
        raise ValueError(
            f"{type(module).__name__}: the forward of {where} fails after the tensor-parallel rewrite "
            f"({type(err).__name__}: {err}). Attention/MLP code must take head counts and widths from attributes "
            f"(divided by tp, e.g. `self.n_head`, `self.split_size`) or from `-1` in view/reshape, not from its "
            f"input's width (`C // self.n_head` with `B, T, C = x.size()`); otherwise implement "
            f"`fourd_tp_plan(self, tp_mesh, sequence_parallel)`, or use tp=1."
        ) from err
    finally:
        for h in hooks:
            h.remove()
        module.train(was_training)
    diff, scale = _max_diff(got, expected)
    if diff > 1e-5 + _rtol(expected) * scale:
        raise ValueError(
            f"{type(module).__name__}: the tensor-parallel rewrite changes its output (max abs difference "
            f"{diff:.3g} on a test input). Implement `fourd_tp_plan(self, tp_mesh, sequence_parallel)` for this model."
        )


def _rtol(expected: Any) -> float:
    from lightning_4d._compat import pytree

    dtypes = [t.dtype for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max([1e-4] + [16 * torch.finfo(d).eps for d in dtypes])


def _max_diff(got: Any, expected: Any) -> tuple[float, float]:
    from lightning_4d._compat import pytree

    a = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    b = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf"), 0.0
    diff = max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)
    scale = max((float(y.float().abs().max()) for y in b if y.numel()), default=0.0)
    return diff, scale


def _blocks_of(container: nn.Module) -> list[nn.Module]:
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def _apply_experts(module: nn.Module, mesh: FourDMesh, plan: ParallelPlan, accumulate: int) -> None:
    """Rewrite MoE blocks into the package's layer and shard experts over ``ep`` (before TP planning)."""
    from lightning_4d.expert_parallel import MoE, apply_expert_parallel
    from lightning_4d.expert_parallel.rewrite import find_moe_modules

    dims = mesh.dims
    if not find_moe_modules(module):
        if dims.ep > 1:
            raise ValueError(
                f"ep={dims.ep} but {type(module).__name__} has no mixture-of-experts layer (a module with a `gate` "
                f"router and an `experts` list, or lightning_4d's MoE). Use ep=1 for a dense model."
            )
        return
    # Expert gradients are averaged over edp; under SP each TP rank holds different tokens (factor tp).
    grad_scale = (dims.tp if dims.sp else 1) / dims.ep
    stats = None if (dims.sp or dims.tp == 1) else ([("dp", mesh["dp"].get_group())] if dims.dp > 1 else [])
    apply_expert_parallel(module, mesh, grad_scale=grad_scale, stats_groups=stats,
                          aux_grad_scale=dims.dp / max(accumulate, 1))
    for name, moe in module.named_modules():
        if isinstance(moe, MoE):
            plan.expert_modules.append(f"{name}.experts")
            plan.bias_update |= moe.router.expert_bias is not None
            if dims.sp:
                # Router and shared experts see only this rank's sequence shard: sum their grads over tp.
                plan.tp_partial_params += [
                    f"{name}.{n}" for n, _ in moe.named_parameters() if not n.startswith("experts.")
                ]


def _is_within(sub: nn.Module, root: nn.Module) -> bool:
    return any(m is sub for m in root.modules())
