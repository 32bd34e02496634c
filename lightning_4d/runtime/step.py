"""One training step's pieces, owned by the runtime: ``FourDStrategy`` calls them from Lightning's hooks and the
planner's dry run (:mod:`lightning_4d.planner.dry_run`) calls the same functions on a fake process group.

A step, in order:

1. :func:`shard_sequence`: with context parallelism, this rank's zigzag share of the batch (tokens, targets,
   global positions) and its :class:`~lightning_4d.context_parallel.SequenceShard`;
2. :func:`step_loss`: the global-batch loss — the model's forward and ``loss_fn`` under :func:`loss_context`
   (``loss_parallel`` under TP, the attention made global under CP), token-weighted over the ``dp × cp`` ranks
   (:func:`~lightning_4d.core.loss.weighted_global_loss`); under pipeline parallelism forward and backward run inside the
   pipeline (:func:`~lightning_4d.layout.pipeline_glue.pipeline_train_loss`, whose schedule a caller may replace);
3. the backward, under :func:`loss_context` (without pipeline parallelism);
4. :func:`finish_backward`, once per optimizer step: ``tp`` reduction of sequence-parallel partial gradients
   (:func:`~lightning_4d.layout.parallelize.reduce_tp_partial_grads`) and the tied first/last-stage weights' gradients;
5. the optimizer step (:func:`clip_grad_norm` first when the Trainer clips, reusing the non-finite guard's
   :func:`grad_norm_share`), then :func:`after_optimizer_step` (the aux-loss-free expert-bias update).

Counts, flags and norms stay on the device: the step's one host sync is the guard's decision
(:func:`~lightning_4d.safety.nonfinite.check_step`).

Example:
    >>> with loss_context(None, None):  # no plan, no context parallelism: nothing to enter
    ...     pass
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import loss_parallel

from lightning_4d.analysis.hooks import TP_PLAN, hook_call
from lightning_4d.core.batches import batch_tokens, call_model
from lightning_4d.core.comm import internal_comm
from lightning_4d.context_parallel import ContextParallelAttention, SequenceShard, shard_batch
from lightning_4d import _compat
from lightning_4d.core.distributed import global_grad_norm, local_of
from lightning_4d.core.distributed import grad_norm_share as core_grad_norm_share
from lightning_4d.expert_parallel import update_expert_bias
from lightning_4d.core.loss import check_inputs, check_targets, weighted_global_loss
from lightning_4d.mesh import Axis, FourDMesh
from lightning_4d.layout.parallelize import ParallelPlan, reduce_tp_partial_grads
from lightning_4d.layout.pipeline_glue import pipeline_train_loss, sync_tied
from lightning_4d.pipeline.runner import ScheduleRun
from lightning_4d.tensor_parallel.replicas import replica_mismatches

__all__ = ["GradNormShare", "after_optimizer_step", "check_tp_replicas", "clip_grad_norm", "finish_backward",
           "grad_norm_share", "loss_context", "predict_outputs", "shard_sequence", "step_loss"]


def shard_sequence(mesh: FourDMesh, inputs: Any, targets: Any, positions: bool, pipelined: bool
                   ) -> tuple[Any, Any, Optional[SequenceShard]]:
    """This rank's share of ``(inputs, targets)`` along the sequence (cp > 1, :func:`~lightning_4d.context_parallel.
    shard_batch`) and its shard; unchanged (and ``None``) without context parallelism. ``positions``: the model takes
    ``position_ids``.

    Example:
        >>> # not run: needs a process group
        >>> x, y, shard = shard_sequence(mesh, tokens, targets, positions=True, pipelined=False)  # doctest: +SKIP
    """
    dims = mesh.dims
    if dims.cp == 1:
        return inputs, targets, None
    return shard_batch(inputs, targets, mesh[Axis.CP].get_group(), dims.cp, mesh.rank(Axis.CP), positions,
                       tp=dims.tp if dims.sp else 1, pipelined=pipelined)


@contextmanager
def loss_context(plan: Optional[ParallelPlan], shard: Optional[SequenceShard]) -> Generator[None, None, None]:
    """The context of the loss and its backward: ``loss_parallel`` under TP (a vocabulary-parallel head) and, with
    context parallelism, the model's attention made global for ``shard``'s batch by the algorithm the layout plan
    names, each attention call under the mask the set-up check read (in backward too: recomputed activations).

    Example:
        >>> with loss_context(None, None):
        ...     pass
    """
    parallel_loss = plan is not None and getattr(plan, "loss_parallel", False)
    layout = getattr(plan, "layout", None)
    algorithm = (layout.cp_algorithm if layout is not None else "") or "allgather"  # the plan names it
    masks = getattr(plan, "cp_masks", None)  # each call's mask as the set-up check read it
    with loss_parallel() if parallel_loss else nullcontext():
        with ContextParallelAttention(shard, algorithm=algorithm, masks=masks) if shard is not None else nullcontext():
            yield


def step_loss(module: nn.Module, inputs: Any, targets: Any, plan: Optional[ParallelPlan], mesh: FourDMesh,
              positions: bool, stage: str = "train", accumulate: int = 1,
              zero_grad: Callable[[], None] = lambda: None, schedule_run: Optional[ScheduleRun] = None,
              loss_fn: Optional[Callable[[Any, Any], Tensor]] = None, count: Optional[Callable[[Any], Tensor]] = None,
              ) -> tuple[Tensor, Optional[SequenceShard]]:
    """The global-batch loss of ``(inputs, targets)`` on this rank (differentiable without a pipeline; with one, a
    training call has run forward and backward already) and the batch's sequence shard (cp > 1).

    ``zero_grad`` runs before a pipeline's training schedule (gradients are computed inside the step);
    ``schedule_run`` replaces torch's pipeline schedule (the planner's dry run, whose fake group cannot run it).
    ``loss_fn`` and ``count`` (the mean loss, the number of targets it averages over) default to the module's
    ``loss_fn`` and ``count_targets`` (:class:`~lightning_4d.FourDModule`); a pipeline's loss is the runner's.

    Example:
        >>> # not run: needs a process group
        >>> loss, shard = step_loss(module, tokens, targets, plan, mesh, positions=True)  # doctest: +SKIP
    """
    from lightning_4d.layout.pipeline_glue import pipeline_eval

    check_inputs(batch_tokens(inputs), plan.input_shape if plan is not None else None)
    check_targets(targets, plan is not None and plan.loss_parallel)
    runner = plan.pipeline if plan is not None else None
    inputs, targets, shard = shard_sequence(mesh, inputs, targets, positions, pipelined=runner is not None)
    # The ranks holding different tokens of one model replica: dp, or dp × cp with context parallelism. Always that
    # group (size 1 when dp·cp == 1: no reduction), never None: torch.distributed reads None as the *world*, which
    # would count the targets once per tp/pp peer and scale the backward loss by 1/(tp·pp).
    batch_ranks = mesh.dims.dp_cp
    group = mesh[Axis.DP_CP].get_group()

    def context() -> Any:
        return loss_context(plan, shard)

    count = count or module.count_targets
    if runner is not None:
        if stage == "train" and module.training and torch.is_grad_enabled():
            zero_grad()
            return pipeline_train_loss(runner, module, inputs, targets, group, batch_ranks, accumulate, context,
                                       schedule_run=schedule_run, count=count), shard
        return pipeline_eval(runner, module, inputs, targets, group, context, count=count), shard
    with context():
        outputs = call_model(module, inputs)
        local = (loss_fn or module.loss_fn)(outputs, targets)
    n_local = count(targets)
    return weighted_global_loss(local, n_local.to(local.device), group, batch_ranks), shard


@torch.no_grad()
def predict_outputs(module: nn.Module, inputs: Any, plan: Optional[ParallelPlan], mesh: FourDMesh,
                    positions: bool) -> Any:
    """The full (unsharded) model outputs for ``inputs`` on every rank. With context parallelism the sequence is
    split like a training batch (each rank runs its zigzag share, attention global), and the outputs ``(B, T/cp,
    …)`` are all-gathered over the cp ranks and put back in sequence order ``(B, T, …)``.

    Example:
        >>> # not run: needs a process group
        >>> logits = predict_outputs(module, tokens, plan, mesh, positions=True)  # doctest: +SKIP
    """
    from lightning_4d.core.distributed import to_full
    from lightning_4d.layout.pipeline_glue import pipeline_eval

    runner = plan.pipeline if plan is not None else None
    tokens = batch_tokens(inputs)
    local, _, shard = shard_sequence(mesh, inputs, tokens, positions, pipelined=runner is not None)

    def enter() -> Any:
        return loss_context(plan, shard)

    if runner is not None:
        out = pipeline_eval(runner, module, local, None, mesh[Axis.DP].get_group(), enter)
    else:
        with enter():
            out = to_full(call_model(module, local))
    if shard is None:
        return out
    return _whole_sequence(out, shard, tokens.shape[1])


def _whole_sequence(out: Any, shard: SequenceShard, seq_len: int) -> Tensor:
    """This rank's outputs ``(B, T/cp, …)`` and the other cp ranks' as ``(B, T, …)`` in sequence order."""
    from lightning_4d.context_parallel.collectives import gather_sequence
    from lightning_4d.context_parallel.zigzag import restore_order

    if not isinstance(out, Tensor) or out.dim() < 2 or out.shape[1] != seq_len // shard.cp:
        raise ValueError(
            f"predict under context parallelism gathers the model's outputs along the sequence, so they must be one "
            f"(batch, sequence, …) tensor; got {type(out).__name__} {tuple(getattr(out, 'shape', ()))} for "
            f"{seq_len // shard.cp} local tokens. Return logits from forward, or predict with cp=1.")
    gathered = gather_sequence(out.contiguous(), shard.group)  # (cp, B, T/cp, …)
    whole = gathered.movedim(0, 1).flatten(1, 2)  # (B, T, …) in rank order
    return whole.index_select(1, restore_order(seq_len, shard.cp, device=out.device))  # (B, T, …)


def finish_backward(plan: Optional[ParallelPlan], mesh: FourDMesh, model: nn.Module) -> None:
    """Once per optimizer step, after the last backward of the window: the ``tp`` reduction of gradients that saw
    only this rank's sequence shard (:func:`~lightning_4d.layout.parallelize.reduce_tp_partial_grads`) and, under pipeline
    parallelism, the sum of the gradients of weights tied between the first and last stage.

    Example:
        >>> # not run: needs a process group
        >>> finish_backward(plan, mesh, model)  # doctest: +SKIP
    """
    reduce_tp_partial_grads(plan, mesh, model)
    if plan is not None and plan.pipeline is not None:
        sync_tied(model, plan.pipeline, plan.pipeline_tied)


@dataclass(frozen=True)
class GradNormShare:
    """This rank's share of the squared global gradient norm (:func:`grad_norm_share`), kept on the device by the
    non-finite guard so that clipping reuses it instead of a second pass over every gradient.

    Attributes:
        params: ``id`` of each parameter it covers, in order (clipping reuses it only for the same list).
        norm_type: the ``p`` of the norm.
        value: the device scalar (not reduced over the ranks).
    """

    params: tuple[int, ...]
    norm_type: float
    value: Tensor


def grad_norm_share(plan: Optional[ParallelPlan], model: nn.Module, parameters: Iterable[nn.Parameter],
                    norm_type: float = 2.0) -> GradNormShare:
    """This rank's share of ``‖g‖^p`` over ``parameters`` (:func:`~lightning_4d.core.distributed.grad_norm_share`,
    the last stage's copy of a tied weight counted once): what :func:`clip_grad_norm` all-reduces. No host sync.

    Example:
        >>> lin = nn.Linear(2, 1); lin(torch.ones(1, 2)).sum().backward()
        >>> float(grad_norm_share(None, lin, lin.parameters()).value)
        3.0
    """
    params = list(parameters)
    tied = _tied_copies(plan, model)
    pp = plan.pipeline.pp if plan is not None and plan.pipeline is not None else 1
    value = core_grad_norm_share([p for p in params if p.grad is not None and id(p) not in tied], norm_type, pp)
    return GradNormShare(tuple(id(p) for p in params), float(norm_type), value)


def clip_grad_norm(plan: Optional[ParallelPlan], model: nn.Module, parameters: Iterable[nn.Parameter],
                   max_norm: float, norm_type: float = 2.0, share: Optional[GradNormShare] = None) -> Tensor:
    """Clip gradients by the global norm across every tp / pp / ep / dp / cp shard (one scalar all-reduce,
    :func:`~lightning_4d.core.distributed.global_grad_norm`; the last stage's copy of a tied weight counted once); returns
    the norm before clipping (a device scalar). ``share``: the guard's :func:`grad_norm_share` of the same
    parameters (reused when it matches them and ``norm_type``). As ``torch.nn.utils.clip_grad_norm_``: every
    gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))`` computed on the device (no host sync), one
    fused multiply per device.

    Example:
        >>> lin = nn.Linear(2, 1); lin(torch.ones(1, 2)).sum().backward()
        >>> round(float(clip_grad_norm(None, lin, lin.parameters(), 1.0)), 4), round(float(lin.weight.grad.norm()), 2)
        (1.7321, 0.82)
    """
    params = list(parameters)
    if share is None or share.params != tuple(id(p) for p in params) or share.norm_type != float(norm_type):
        share = grad_norm_share(plan, model, params, norm_type)
    total = global_grad_norm([], norm_type, share=share.value)
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)  # () on the device: torch's own rule
    by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
    for p in params:  # local shards: grads may be plain tensors and DTensors on several meshes
        if p.grad is not None:
            g = local_of(p.grad)
            by_device[g.device].append(g)
    with torch.no_grad():
        for device, grads in by_device.items():
            _compat.foreach_mul_(grads, coef.to(device))
    return total


def _tied_copies(plan: Optional[ParallelPlan], model: nn.Module) -> set[int]:
    """Parameters that are the last stage's copy of a weight tied to the first stage (counted once)."""
    runner = plan.pipeline if plan is not None else None
    tied = plan.pipeline_tied if plan is not None else []
    if runner is None or not tied or runner.first_rank == runner.last_rank or not runner.has_last:
        return set()
    params = dict(model.named_parameters(remove_duplicate=False))
    return {id(params[post]) for _, post in tied if post in params}


def after_optimizer_step(plan: Optional[ParallelPlan], model: nn.Module) -> None:
    """After the optimizer step, on every rank: the aux-loss-free expert-bias update when the plan has one, and
    the Float8 weights' scales when FSDP2 gathers them in Float8.

    Example:
        >>> after_optimizer_step(None, nn.Linear(2, 2))  # no plan: nothing to update
    """
    if plan is not None and plan.bias_update:
        update_expert_bias(model)
    if plan is not None and plan.float8_fsdp_scales:
        from lightning_4d.speed.float8 import precompute_fsdp_scales

        precompute_fsdp_scales(model)


def check_tp_replicas(model: nn.Module, mesh: FourDMesh) -> None:
    """After the first optimizer step (tp > 1): every parameter tensor parallelism left whole must be identical on
    all TP ranks (:func:`~lightning_4d.tensor_parallel.replicas.replica_mismatches`); one that is not (a gradient
    from sharded activations never summed) fails loudly. Collective over ``tp``, once per run.

    Example:
        >>> # not run: needs a process group
        >>> check_tp_replicas(model, mesh)  # doctest: +SKIP
    """
    with internal_comm():  # a one-time check, not the step's communication
        bad = replica_mismatches(model, mesh[Axis.TP].get_group())
    if bad:
        raise RuntimeError(
            f"After the first optimizer step these parameters differ across the {mesh.dims.tp} tensor-parallel "
            f"ranks although each rank holds them whole: {', '.join(bad[:8])}{' …' if len(bad) > 8 else ''}. "
            f"They see sharded activations whose gradients were not summed, so training would go on wrong. "
            f"Implement {hook_call(TP_PLAN)} to shard them, or use tp=1."
        )
