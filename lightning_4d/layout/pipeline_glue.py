"""Pipeline parallelism inside Lightning's loop: split, schedule, and the step functions.

With ``pp > 1`` the forward and backward of every micro-batch run inside the torch schedule during
``training_step``. Lightning's own ``backward`` is skipped by the strategy and its ``zero_grad``
(which Lightning runs *after* ``training_step``) by the mixin; gradients are zeroed by the strategy
before the first micro-step of each accumulation window instead.

Loss weighting: each rank counts its valid targets ``n_r``; ``N = Σ_dp n_r``. Every micro-batch
contributes ``mean_i · n_i / N`` scaled by ``dp / accumulate_grad_batches`` to the gradients (data
parallelism averages over ``dp``), so the gradient is that of the global-batch token mean; the value
returned and logged is ``Σ_dp Σ_i mean_i · n_i / N`` on every rank.

The functions take what they use (runner, groups, degrees), not the strategy.

Example:
    >>> # not run: needs a process group
    >>> loss = pipeline_train_loss(runner, lm, x, y, dp_group, dp, 1, strategy.loss_context)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_4d.core.batches import PackedInputs, check_takes_positions
from lightning_4d.core.distributed import all_reduce_sum, to_full
from lightning_4d.analysis.hooks import PIPELINE_HOOKS, PIPELINE_POST, PIPELINE_PRE, PIPELINE_SPLIT, user_hook
from lightning_4d.plan import LayoutPlan
from lightning_4d.mesh import Axis, FourDMesh
from lightning_4d.pipeline.checks import check_staged
from lightning_4d.pipeline.partition import PipelineSplit, stage_ids_for_rank
from lightning_4d.pipeline.runner import PipelineRunner, ScheduleRun
from lightning_4d.pipeline.schedules import get_schedule_info
from lightning_4d.pipeline.staged import StagedForward
from lightning_4d.pipeline.stages import ChainForward, PipelineParts, StageForward, find_pipeline_split, prune_stages
from lightning_4d.pipeline.tied import sync_tied_grads
from lightning_4d.core.verify import (
    changed_output_error, check_tensor_parallel, running_modules, tensor_parallel_failure,
)

__all__ = ["check_after_tensor_parallel", "hooks_split", "install_stages", "split_pipeline", "build_runner",
           "check_packed", "pipeline_train_loss", "pipeline_eval", "sync_tied", "uses_pipeline_hooks"]


def hooks_split(module: nn.Module, blocks_path: str) -> PipelineSplit:
    """The split the user's pipeline hooks name: :func:`~lightning_4d.analysis.hooks.PipelineSplitHook`'s answer (a blocks
    path or a full split), else the modules found around ``blocks_path``.

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList([nn.Linear(2, 2)]))
        >>> hooks_split(net, "layers").block_keys
        ('0',)
    """
    hook = user_hook(module, PIPELINE_SPLIT)
    split = hook() if hook else find_pipeline_split(module, blocks_path)
    return find_pipeline_split(module, split) if isinstance(split, str) else split


def install_stages(module: nn.Module, plan: LayoutPlan) -> StageForward:
    """How the stages of ``module`` (still whole) run, installed on it: the chain its pipeline hooks name
    (``plan.pipeline_hooks``), else its own forward stage by stage. The one builder of stages from the plan's
    stage assignment; :func:`split_pipeline` prunes what it returns.

    Example:
        >>> net = nn.Sequential(); net.add_module("layers", nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        >>> plan = LayoutPlan(degrees=(("pp", 2),), blocks_path="layers", block_order=("0", "1"),
        ...                   stages=(("0",), ("1",)), pipeline_hooks=True)
        >>> install_stages(net, plan).num_stages
        2
    """
    if plan.pipeline_hooks:
        stages: StageForward = ChainForward(module, hooks_split(module, plan.blocks_path), plan.stage_keys(),
                                            user_hook(module, PIPELINE_PRE), user_hook(module, PIPELINE_POST))
    else:
        stages = StagedForward(module, plan.model_trace(), plan.stage_keys())
    stages.install()
    return stages


def uses_pipeline_hooks(module: nn.Module) -> bool:
    """Whether the user split the model by hand (then stages chain pre → blocks → post as told)."""
    return any(user_hook(module, name) for name in PIPELINE_HOOKS)


def check_after_tensor_parallel(module: nn.Module, stages: Optional[StageForward], example: Any, expected: Any
                                ) -> None:
    """After the tensor-parallel rewrite, the sharded model against the unsharded output on the traced input:
    the plain forward without a pipeline (:func:`~lightning_4d.core.verify.check_tensor_parallel`), else the stages in
    order (:func:`~lightning_4d.pipeline.checks.check_staged`).

    Example:
        >>> lin, x = nn.Linear(2, 2), torch.ones(1, 2)
        >>> check_after_tensor_parallel(lin, None, x, lin(x).detach())  # the same forward: passes
    """
    if stages is None:
        check_tensor_parallel(module, example, expected)
        return
    # the stages alone were checked before the rewrite: what fails now is the rewrite's, named like tp alone's
    with running_modules(stages.root) as where:
        check_staged(stages, example, expected,
                     failed=lambda err: tensor_parallel_failure(stages.root, where(), err),
                     differs=lambda diff, _allowed: changed_output_error(stages.root, diff, "run stage by stage"))


def split_pipeline(mesh: FourDMesh, plan: LayoutPlan, stages: StageForward) -> PipelineParts:
    """Prune the model in place to this rank's stages (original parameter names kept), placed as the plan's
    schedule places them.

    Example:
        >>> # not run: needs a process group
        >>> parts = split_pipeline(mesh, plan, install_stages(lm, plan))  # doctest: +SKIP
    """
    dims = mesh.dims
    style = get_schedule_info(plan.schedule).style
    return prune_stages(stages, stage_ids_for_rank(mesh.rank(Axis.PP), dims.pp, dims.virtual_stages, style))


def build_runner(module: nn.Module, mesh: FourDMesh, plan: LayoutPlan, parts: PipelineParts,
                 microbatches: Optional[int] = None, device: Optional[torch.device] = None,
                 loss_fn: Optional[Callable[..., Any]] = None) -> PipelineRunner:
    """The plan's torch schedule over this rank's (already TP/DP-wrapped) stage modules, ``microbatches`` per step
    (``None``: the schedule's default), on ``device`` (default: the stages' parameters' device; a model still on
    the meta device passes the device it will be materialised on). Stages that run the model's own forward get the
    micro-batch's inputs on every stage. ``loss_fn``: the loss of the last stage (default: ``module.loss_fn``).

    Example:
        >>> # not run: needs a process group
        >>> runner = build_runner(lm, mesh, plan, parts, microbatches=4)  # doctest: +SKIP
    """
    ignore = getattr(module, "ignore_index", -100)
    count = getattr(module, "count_targets", None)
    return PipelineRunner(
        parts.modules, mesh[Axis.PP], loss_fn if loss_fn is not None else module.loss_fn, schedule=plan.schedule,
        microbatches=microbatches,
        inputs_to_every_stage=parts.modules[0].stage_forward.inputs_to_every_stage,
        ignore_index=-100 if ignore is None else ignore,
        token_count_fn=count if callable(count) else None,  # a device tensor: never read on the host
        model=module,  # tied weights are synchronised by the strategy once per optimizer step
        device=device,
    )


def sync_tied(model: nn.Module, runner: PipelineRunner, tied: Sequence[tuple[str, str]]) -> None:
    """Sum the gradients of weights tied between the first and last stage (once per optimizer step).

    Example:
        >>> # not run: needs a process group
        >>> sync_tied(strategy.model, plan.pipeline, plan.pipeline_tied)  # doctest: +SKIP
    """
    if tied:
        sync_tied_grads(model, list(tied), runner.group, runner.first_rank, runner.last_rank)


def check_packed(runner: PipelineRunner, module: nn.Module, inputs: Any) -> None:
    """Refuse packed inputs (:class:`~lightning_4d.core.batches.PackedInputs`) that the stages cannot carry to every
    block: with user pipeline hooks a stage chains ``pre → blocks → post`` on the activation alone, so the blocks of
    later stages would not see ``position_ids`` and attention would cross document boundaries. Raised on every rank
    before the step's first collective.

    Example:
        >>> # not run: needs a process group
        >>> check_packed(plan.pipeline, lm, PackedInputs(tokens, position_ids))  # doctest: +SKIP
    """
    if not isinstance(inputs, PackedInputs):
        return
    if not runner.inputs_to_every_stage:
        raise ValueError(
            f"a packed batch (with position_ids) under pp={runner.pp} with the pipeline hooks of "
            f"{type(module).__name__}: stages chain pre → blocks → post on the activation only, so blocks on later "
            f"stages would not get position_ids and attention would cross document boundaries. Remove the hooks (the "
            f"stages then run the model's own forward, which passes position_ids on), use pp=1, or batches without "
            f"position_ids.")
    check_takes_positions(module)


def _token_total(count: Callable[[Any], Tensor], targets: Tensor, dp_group: dist.ProcessGroup) -> Tensor:
    """The step's valid targets over the dp group, a device scalar (the runner makes 0 into 1)."""
    n = count(targets).to(torch.float64).reshape(1).clone()
    return all_reduce_sum(n, dp_group)[0]


def pipeline_train_loss(runner: PipelineRunner, module: nn.Module, inputs: Any, targets: Tensor,
                        dp_group: dist.ProcessGroup, dp: int, accumulate: int,
                        loss_context: Callable[[], ContextManager[None]],
                        schedule_run: Optional[ScheduleRun] = None,
                        count: Optional[Callable[[Any], Tensor]] = None) -> Tensor:
    """Run forward + backward of the local batch through the schedule; return the global loss. ``schedule_run``
    replaces torch's schedule (:data:`~lightning_4d.pipeline.runner.ScheduleRun`: the planner's dry run);
    ``count``: the valid targets of a batch (default: ``module.count_targets``).

    ``dp_group`` is always the dp group (size 1 when ``dp == 1``): ``None`` would mean the whole world,
    where TP/PP peers hold the same targets and would be counted again. Gradients must have been zeroed
    before the first micro-step of the accumulation window (the caller's job).

    Example:
        >>> # not run: needs a process group
        >>> loss = pipeline_train_loss(runner, lm, x, y, mesh["dp"].get_group(), 2, 1, nullcontext)  # doctest: +SKIP
    """
    check_packed(runner, module, inputs)
    total = _token_total(count or module.count_targets, targets, dp_group)
    with loss_context():
        local = runner.train_step(inputs, targets, grad_scale=dp / accumulate, num_tokens=total,
                                  schedule_run=schedule_run)
    return all_reduce_sum(local.detach().to(torch.float64).reshape(1).clone(), dp_group)[0].float()


def pipeline_eval(runner: PipelineRunner, module: nn.Module, inputs: Any, targets: Optional[Tensor],
                  dp_group: dist.ProcessGroup, loss_context: Callable[[], ContextManager[None]],
                  count: Optional[Callable[[Any], Tensor]] = None) -> Any:
    """Forward-only through the schedule: the global loss (with targets) or the full outputs (without).
    ``count``: the valid targets of a batch (default: ``module.count_targets``).

    Example:
        >>> # not run: needs a process group
        >>> out = pipeline_eval(runner, lm, x, None, mesh["dp"].get_group(), nullcontext)  # doctest: +SKIP
    """
    check_packed(runner, module, inputs)
    if targets is None:
        with loss_context():
            return to_full(runner.eval_step(inputs, None).output)
    total = _token_total(count or module.count_targets, targets, dp_group)
    with loss_context():
        loss = runner.eval_step(inputs, targets, num_tokens=total, broadcast_outputs=False).loss
    return all_reduce_sum(loss.detach().to(torch.float64).reshape(1).clone(), dp_group)[0].float()
