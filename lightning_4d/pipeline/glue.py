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

from typing import Any, Callable, ContextManager, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_4d.batches import PackedInputs, check_takes_positions
from lightning_4d.config import FourDConfig
from lightning_4d.distributed import all_reduce_sum, is_on_meta, to_full
from lightning_4d.hooks import PIPELINE_HOOKS, PIPELINE_POST, PIPELINE_PRE, PIPELINE_SPLIT, user_hook
from lightning_4d.mesh import Axis, FourDMesh
from lightning_4d.pipeline.checks import check_sequential
from lightning_4d.pipeline.partition import PipelineSplit, stage_ids_for_rank
from lightning_4d.pipeline.runner import PipelineRunner, ScheduleRun
from lightning_4d.pipeline.schedules import get_schedule_info
from lightning_4d.pipeline.staged import StagedForward, check_staged, prune_staged
from lightning_4d.pipeline.stages import PipelineParts, build_pipeline_stages, find_pipeline_split
from lightning_4d.pipeline.tied import sync_tied_grads
from lightning_4d.trace import example_tokens
from lightning_4d.verify import check_tensor_parallel

__all__ = ["ModelSplit", "check_after_tensor_parallel", "check_pipeline_model", "split_pipeline",
           "build_runner", "check_packed", "pipeline_train_loss", "pipeline_eval", "staged_forward", "sync_tied",
           "uses_pipeline_hooks"]

# How a model is cut into pipeline stages: its own forward run stage by stage (no hooks), or the chain
# pre → blocks → post that the user's pipeline hooks name. :func:`staged_forward` tells them apart.
ModelSplit = Union[StagedForward, PipelineSplit]


def staged_forward(split: ModelSplit) -> Optional[StagedForward]:
    """The one place the two pipeline mechanisms are told apart: the :class:`StagedForward` when the stages run
    the model's own forward, ``None`` when they chain what the pipeline hooks name.

    Example:
        >>> staged_forward(PipelineSplit("layers", ("0", "1"))) is None
        True
    """
    return split if isinstance(split, StagedForward) else None


def check_pipeline_model(module: nn.Module, blocks_path: str, values: bool = True) -> PipelineSplit:
    """Find the split and check on a tiny input (:func:`~lightning_4d.trace.example_tokens`, the one builder of
    example inputs) that pre → blocks → post equals ``module(inputs)``.

    Runs on the full (unsharded) model on every rank before any collective; a mismatch raises a
    ``ValueError`` naming the hooks ``pipeline_pre_blocks`` / ``pipeline_post_blocks`` /
    ``configure_pipeline_split``. On the meta device (a planner dry run), or with ``values=False`` (planning),
    there is no data to compare: the split only, as :func:`~lightning_4d.pipeline.staged.check_staged` does.
    """
    hook = user_hook(module, PIPELINE_SPLIT)
    split = hook() if hook else find_pipeline_split(module, blocks_path)
    if isinstance(split, str):
        split = find_pipeline_split(module, split)
    if not values or is_on_meta(module):
        return split
    with torch.no_grad():
        was_training = module.training
        module.eval()  # dropout off for the comparison
        try:
            check_sequential(module, example_tokens(module), split=split,
                             pre_fn=user_hook(module, PIPELINE_PRE), post_fn=user_hook(module, PIPELINE_POST))
        finally:
            module.train(was_training)
    return split


def uses_pipeline_hooks(module: nn.Module) -> bool:
    """Whether the user split the model by hand (then stages chain pre → blocks → post as told)."""
    return any(user_hook(module, name) for name in PIPELINE_HOOKS)


def check_after_tensor_parallel(module: nn.Module, split: Optional[ModelSplit], example: Any, expected: Any) -> None:
    """After the tensor-parallel rewrite, the sharded model against the unsharded output on the traced input:
    the plain forward without a pipeline (:func:`~lightning_4d.verify.check_tensor_parallel`), the stages in
    order when they run the model's own forward; a chain the pipeline hooks name was checked before sharding
    (:func:`check_pipeline_model`).

    Example:
        >>> lin, x = nn.Linear(2, 2), torch.ones(1, 2)
        >>> check_after_tensor_parallel(lin, None, x, lin(x).detach())  # the same forward: passes
    """
    if split is None:
        check_tensor_parallel(module, example, expected)
        return
    staged = staged_forward(split)
    if staged is None:
        return
    try:
        check_staged(staged, example, expected)
    except ValueError as err:
        raise ValueError(f"With tensor parallelism: {err}") from err


def split_pipeline(module: nn.Module, mesh: FourDMesh, config: FourDConfig, split: ModelSplit) -> PipelineParts:
    """Prune ``module`` in place to this rank's stages (original parameter names kept)."""
    dims = mesh.dims
    info = get_schedule_info(config.schedule)
    staged = staged_forward(split)
    if staged is not None:
        return prune_staged(staged, stage_ids_for_rank(mesh.rank(Axis.PP), dims.pp, dims.virtual_stages, info.style))
    assert isinstance(split, PipelineSplit)
    return build_pipeline_stages(
        module, mesh.rank(Axis.PP), dims.pp, dims.virtual_stages, info.style, split=split,
        pre_fn=user_hook(module, PIPELINE_PRE), post_fn=user_hook(module, PIPELINE_POST),
    )


def build_runner(module: nn.Module, mesh: FourDMesh, config: FourDConfig, parts: PipelineParts, split: ModelSplit,
                 device: Optional[torch.device] = None) -> PipelineRunner:
    """The torch schedule over this rank's (already TP/DP-wrapped) stage modules, on ``device`` (default: the
    stages' parameters' device; a model still on the meta device passes the device it will be materialised on).
    Stages that run the model's own forward get the micro-batch's inputs on every stage."""
    ignore = getattr(module, "ignore_index", -100)
    count = getattr(module, "count_targets", None)
    return PipelineRunner(
        parts.modules, mesh[Axis.PP], module.loss_fn, schedule=config.schedule, microbatches=config.microbatches,
        inputs_to_every_stage=staged_forward(split) is not None,
        ignore_index=-100 if ignore is None else ignore,
        token_count_fn=(lambda t: int(count(t))) if callable(count) else None,
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
    """Refuse packed inputs (:class:`~lightning_4d.batches.PackedInputs`) that the stages cannot carry to every
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


def _token_total(module: nn.Module, targets: Tensor, dp_group: dist.ProcessGroup) -> float:
    n = module.count_targets(targets).to(torch.float64).reshape(1).clone()
    return float(all_reduce_sum(n, dp_group)[0])


def pipeline_train_loss(runner: PipelineRunner, module: nn.Module, inputs: Any, targets: Tensor,
                        dp_group: dist.ProcessGroup, dp: int, accumulate: int,
                        loss_context: Callable[[], ContextManager[None]],
                        schedule_run: Optional[ScheduleRun] = None) -> Tensor:
    """Run forward + backward of the local batch through the schedule; return the global loss. ``schedule_run``
    replaces torch's schedule (:data:`~lightning_4d.pipeline.runner.ScheduleRun`: the planner's dry run).

    ``dp_group`` is always the dp group (size 1 when ``dp == 1``): ``None`` would mean the whole world,
    where TP/PP peers hold the same targets and would be counted again. Gradients must have been zeroed
    before the first micro-step of the accumulation window (the caller's job).

    Example:
        >>> # not run: needs a process group
        >>> loss = pipeline_train_loss(runner, lm, x, y, mesh["dp"].get_group(), 2, 1, nullcontext)  # doctest: +SKIP
    """
    check_packed(runner, module, inputs)
    total = _token_total(module, targets, dp_group)
    with loss_context():
        local = runner.train_step(inputs, targets, grad_scale=dp / accumulate, num_tokens=total or 1.0,
                                  schedule_run=schedule_run)
    return all_reduce_sum(local.detach().to(torch.float64).reshape(1).clone(), dp_group)[0].float()


def pipeline_eval(runner: PipelineRunner, module: nn.Module, inputs: Any, targets: Optional[Tensor],
                  dp_group: dist.ProcessGroup, loss_context: Callable[[], ContextManager[None]]) -> Any:
    """Forward-only through the schedule: the global loss (with targets) or the full outputs (without).

    Example:
        >>> # not run: needs a process group
        >>> out = pipeline_eval(runner, lm, x, None, mesh["dp"].get_group(), nullcontext)  # doctest: +SKIP
    """
    check_packed(runner, module, inputs)
    if targets is None:
        with loss_context():
            return to_full(runner.eval_step(inputs, None).output)
    total = _token_total(module, targets, dp_group)
    with loss_context():
        loss = runner.eval_step(inputs, targets, num_tokens=total or 1.0, broadcast_outputs=False).loss
    return all_reduce_sum(loss.detach().to(torch.float64).reshape(1).clone(), dp_group)[0].float()
