"""Run one rank's pipeline stages with a torch schedule: train and eval steps, loss everywhere.

Loss weighting (exact parity with the single-process full-batch loss): the user's
``loss_fn(output, target)`` returns the *mean* over the valid tokens of its micro-batch (or a
``(sum, count)`` pair). Before the schedule runs, the valid tokens of the whole local batch are
counted once (``target != ignore_index``; ``num_tokens=`` overrides it, e.g. with a count summed
over data-parallel ranks). Counts stay on the device: a step reads none of them on the host. Each
micro-batch loss is then rescaled inside the loss function handed to torch: ``mean_i · n_i / N`` (or
``sum_i / N``), times ``grad_scale``. Summed over micro-batches this is the full-batch mean, so the accumulated
gradients equal the single-process gradients even when ``ignore_index`` positions differ per micro-batch; torch's
own ``1/m`` scaling is disabled (``scale_grads=False``). A micro-batch without valid tokens contributes zero (not
NaN), and its ``loss_fn`` backward gets a zero gradient (``F.cross_entropy`` then gives zeros; a loss dividing by
its own count would give NaN there: return ``(sum, count)`` instead).

The loss returned by :meth:`PipelineRunner.train_step` is the local-batch loss (``grad_scale``
undone), broadcast from the last stage over the pp group, so every pp rank returns the same value.

Example:
    >>> # not run: needs a process group
    >>> parts = build_pipeline_stages(model, pp_rank, pp)  # doctest: +SKIP
    >>> runner = PipelineRunner(parts.modules, mesh["pp"], F.cross_entropy, schedule="1f1b")  # doctest: +SKIP
    >>> loss = runner.train_step(tokens, targets)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_4d import _compat
from lightning_4d._compat import pytree
from lightning_4d.core.distributed import local_of
from lightning_4d.core.loss import count_targets, token_weighted
from lightning_4d.pipeline.partition import stage_ids_for_rank, stage_to_rank
from lightning_4d.pipeline.schedules import get_schedule_info, validate_microbatches
from lightning_4d.pipeline.stages import INPUTS_KW
from lightning_4d.pipeline.tied import sync_tied_grads

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PipelineRunner", "EvalOutput", "ScheduleRun", "default_token_count"]

LossFn = Callable[[Any, torch.Tensor], Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]
#: What runs one training step's micro-batches in place of torch's schedule (the planner's dry run, whose fake
#: process group cannot run its point-to-point): ``run(runner, args, target, losses, kwargs)`` runs forward and
#: backward, computing each micro-batch loss with :meth:`PipelineRunner.scaled_loss` and appending it to ``losses``.
ScheduleRun = Callable[["PipelineRunner", tuple, Optional[torch.Tensor], list, dict], None]


class EvalOutput(NamedTuple):
    """Result of :meth:`PipelineRunner.eval_step`: merged last-stage outputs and the loss (or ``None``)."""

    output: Any
    loss: Optional[torch.Tensor]


def default_token_count(target: torch.Tensor, ignore_index: int = -100) -> int:
    """Valid targets in ``target`` (:func:`lightning_4d.core.loss.count_targets`, as an int).

    Example:
        >>> default_token_count(torch.tensor([[1, -100], [2, 3]]))
        3
    """
    return int(count_targets(target, ignore_index))


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _batch_size(value: Any) -> Optional[int]:
    leaves = _leaves(value)
    return int(leaves[0].shape[0]) if leaves else None


class PipelineRunner:
    """One rank's pipeline: torch ``PipelineStage`` objects plus a torch schedule.

    Args:
        stage_modules: this rank's stage modules, ascending stage index (e.g. ``PipelineParts.modules``).
        pp_group: the pipeline process group, or a 1-D ``DeviceMesh`` (e.g. ``mesh["pp"]``).
        loss_fn: ``loss_fn(output, target)`` → mean over the micro-batch's valid tokens, or
            ``(sum, count)`` (then only the sum is used; the normaliser is the up-front token count).
        schedule: registry name (``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``, ``"zbv"``, ``"dualpipev"``, ...).
        microbatches: micro-batches per step (``None``: ``pp · virtual_stages``, see
            :func:`~lightning_4d.pipeline.schedules.default_microbatches`).
        stage_ids / num_stages: taken from the modules' ``stage_index`` / ``num_stages`` if omitted.
        ignore_index: target value excluded from token counts.
        token_count_fn: ``fn(target) -> count`` (a device tensor, or a number) replacing :func:`default_token_count`.
        device: device of the stages (default: that of their first parameter).
        model / tied: the pruned model and its tied first/last-stage parameter pairs; the gradients
            are summed between the owning ranks after each train step.
        inputs_to_every_stage: pass each micro-batch's inputs to every stage as the keyword
            ``fourd_inputs`` (stages that run the model's own forward need them).

    Example:
        >>> # not run: needs a process group
        >>> runner = PipelineRunner(parts.modules, pp_group, loss_fn, schedule="zbv")  # doctest: +SKIP
    """

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        pp_group: Union[dist.ProcessGroup, DeviceMesh],
        loss_fn: LossFn,
        *,
        schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        stage_ids: Optional[Sequence[int]] = None,
        num_stages: Optional[int] = None,
        ignore_index: int = -100,
        token_count_fn: Optional[Callable[[torch.Tensor], Union[torch.Tensor, float]]] = None,
        device: Optional[Union[str, torch.device]] = None,
        model: Optional[nn.Module] = None,
        tied: Sequence[tuple[str, str]] = (),
        inputs_to_every_stage: bool = False,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        if hasattr(pp_group, "get_group"):  # a 1-D DeviceMesh
            pp_group = pp_group.get_group()
        self.group = pp_group
        self.pp = dist.get_world_size(pp_group)
        self.pp_rank = dist.get_rank(pp_group)
        self.info = get_schedule_info(schedule)
        modules = list(stage_modules)
        if not modules:
            raise ValueError("stage_modules is empty: every pp rank needs at least one stage.")
        self.virtual_stages = len(modules)
        self.info.check_virtual_stages(self.virtual_stages)
        ids = list(stage_ids) if stage_ids is not None else [int(getattr(m, "stage_index")) for m in modules]
        self.num_stages = int(num_stages if num_stages is not None else getattr(modules[0], "num_stages"))
        expected = stage_ids_for_rank(self.pp_rank, self.pp, self.virtual_stages, self.info.style)
        if ids != expected or self.num_stages != self.pp * self.virtual_stages:
            raise ValueError(
                f"pp rank {self.pp_rank} holds stages {ids} of {self.num_stages}, but schedule {self.info.name!r} with "
                f"pp={self.pp} and {self.virtual_stages} stage(s) per rank places stages {expected} of "
                f"{self.pp * self.virtual_stages} here ({self.info.style!r} placement). Build the stages with "
                f"style={self.info.style!r}."
            )
        self.microbatches = validate_microbatches(self.info, self.pp, self.virtual_stages, microbatches)
        if device is None:
            params = [p for m in modules for p in m.parameters()]
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self.ignore_index = ignore_index
        self.token_count_fn = token_count_fn
        self.model = model
        self.tied = list(tied)
        self.inputs_to_every_stage = inputs_to_every_stage
        self.stage_ids = ids
        self.first_rank = stage_to_rank(0, self.pp, self.info.style)
        self.last_rank = stage_to_rank(self.num_stages - 1, self.pp, self.info.style)
        self.has_first = 0 in ids
        self.has_last = self.num_stages - 1 in ids
        self.stages = [PipelineStage(m, s, self.num_stages, self.device, group=pp_group) for m, s in zip(modules, ids)]
        target = self.stages if self.info.multi_stage else self.stages[0]
        self.schedule = self.info.torch_class(target, self.microbatches, loss_fn=self.scaled_loss, scale_grads=False)
        self._mode = "train"
        self._total: Union[torch.Tensor, float] = 1.0
        self._grad_scale = 1.0

    # -- loss -------------------------------------------------------------------------------
    def _count(self, target: torch.Tensor) -> Union[torch.Tensor, float]:
        """Valid targets of ``target``, on the device when the count is a tensor (read on the host nowhere)."""
        if self.token_count_fn is not None:
            return self.token_count_fn(target)
        return count_targets(target, self.ignore_index)

    def _normaliser(self, num_tokens: Union[torch.Tensor, float, None], targets: torch.Tensor
                    ) -> Union[torch.Tensor, float]:
        """``N`` of the step: ``num_tokens`` (default: the valid targets of ``targets``), 1 where it is 0."""
        total = num_tokens if num_tokens is not None else self._count(targets)
        if isinstance(total, torch.Tensor):
            total = total.detach().to(device=self.device, dtype=torch.float64)
            return torch.where(total == 0, 1.0, total)
        return float(total) or 1.0

    def scaled_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """Micro-batch loss as handed to torch's schedule: its share of the local-batch mean, times ``grad_scale``
        (set by :meth:`train_step`)."""
        if self._mode == "predict":
            return torch.zeros((), device=self.device)
        value = self.loss_fn(output, target)
        if isinstance(value, (tuple, list)):
            total_sum = value[0]
            total = self._total
            if not isinstance(total, torch.Tensor):
                return total_sum / total * self._grad_scale
            opmath = torch.promote_types(total_sum.dtype, torch.float32)  # as a kernel takes a Python scalar
            return (total_sum.to(opmath) / total.to(opmath)).to(total_sum.dtype) * self._grad_scale
        # A mean over nothing (n == 0) is NaN: token_weighted makes it an exact zero, decided on the device (no
        # host sync per micro-batch); loss_fn's backward then sees a zero gradient.
        return token_weighted(local_of(value), self._count(target), self._total, self._grad_scale)

    # -- steps ------------------------------------------------------------------------------
    def _check_batch(self, inputs: Any, targets: Optional[torch.Tensor]) -> int:
        size = _batch_size(inputs) if inputs is not None else None
        if size is None and targets is not None:
            size = _batch_size(targets)
        if size is None:
            raise ValueError("pass the batch (inputs and/or targets) on every pp rank so its size can be checked.")
        validate_microbatches(self.info, self.pp, self.virtual_stages, self.microbatches, size)
        return size

    def _args(self, inputs: Any) -> tuple:
        if not self.has_first:
            return ()
        if inputs is None:
            raise ValueError(f"pp rank {self.pp_rank} runs the first stage and needs the inputs.")
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

    def _kwargs(self, inputs: Any) -> dict[str, Any]:
        # Stages that run the model's own forward derive masks / rotary tables from the inputs.
        if not self.inputs_to_every_stage:
            return {}
        return {INPUTS_KW: inputs}

    def train_step(
        self, inputs: Any, targets: Optional[torch.Tensor], *, grad_scale: float = 1.0,
        num_tokens: Union[torch.Tensor, float, None] = None, schedule_run: Optional[ScheduleRun] = None,
    ) -> torch.Tensor:
        """Forward + backward of the local batch through the schedule; gradients accumulate in ``.grad``.

        Args:
            inputs: model inputs (tensor or tuple of tensors, batch first); used on the first stage.
            targets: targets (batch first); used on the last stage.
            grad_scale: multiplies the gradients (e.g. ``1 / accumulate_grad_batches``); not the returned loss.
            num_tokens: the normaliser ``N`` (default: valid tokens in ``targets``); a tensor stays on the device.
            schedule_run: runs the micro-batches instead of torch's schedule (:data:`ScheduleRun`; the number of
                micro-batches is then its own).

        Returns:
            The local-batch loss as a 0-dim tensor, identical on every pp rank.

        Example:
            >>> # not run: needs a process group
            >>> loss = runner.train_step(tokens, targets)  # doctest: +SKIP
        """
        if schedule_run is None:
            self._check_batch(inputs, targets)
        if self.has_last:
            if targets is None:
                raise ValueError(f"pp rank {self.pp_rank} runs the last stage and needs the targets.")
            self._total = self._normaliser(num_tokens, targets)
        self._grad_scale = float(grad_scale)
        self._mode = "train"
        losses: list[torch.Tensor] = []
        target = targets if self.has_last else None
        if schedule_run is not None:
            schedule_run(self, self._args(inputs), target, losses, self._kwargs(inputs))
        else:
            self.schedule.step(*self._args(inputs), target=target, losses=losses, return_outputs=False,
                               **self._kwargs(inputs))
        loss = torch.zeros((), device=self.device)
        if self.has_last:
            loss = torch.stack([local_of(t).detach().float() for t in losses]).sum() / self._grad_scale
        if self.tied and self.model is not None:
            sync_tied_grads(self.model, self.tied, self.group, self.first_rank, self.last_rank)
        return self._broadcast_loss(loss)

    def eval_step(
        self, inputs: Any, targets: Optional[torch.Tensor] = None, *, num_tokens: Union[torch.Tensor, float, None] = None,
        broadcast_outputs: bool = True,
    ) -> EvalOutput:
        """Forward-only pass (torch's ``schedule.eval``), usable under ``torch.no_grad()``.

        Returns the merged last-stage outputs (broadcast to every pp rank if ``broadcast_outputs``,
        else ``None`` off the last stage) and, if ``targets`` are given, the token-weighted loss on every rank.

        Example:
            >>> # not run: needs a process group
            >>> logits, loss = runner.eval_step(tokens, targets)  # doctest: +SKIP
        """
        size = self._check_batch(inputs, targets)
        target = targets
        if self.has_last:
            if targets is None:
                target = torch.zeros(size, device=self.device)  # splits like the batch; unused
            else:
                self._total = self._normaliser(num_tokens, targets)
        self._mode = "eval" if targets is not None else "predict"
        self._grad_scale = 1.0
        losses: list[torch.Tensor] = []
        try:
            with _compat.forward_only_actions(self.schedule):
                out = self.schedule.eval(*self._args(inputs), target=target if self.has_last else None, losses=losses,
                                         **self._kwargs(inputs))
        finally:
            self._mode = "train"
        loss = None
        if targets is not None:
            value = torch.zeros((), device=self.device)
            if self.has_last:
                value = torch.stack([local_of(t).detach().float() for t in losses]).sum()
            loss = self._broadcast_loss(value)
        if broadcast_outputs:
            from lightning_4d.core.distributed import to_full

            # Vocab-sharded (TP) outputs are gathered on the last stage before the broadcast.
            out = self._broadcast_tree(to_full(out) if self.has_last else None)
        return EvalOutput(out, loss)

    # -- communication ----------------------------------------------------------------------
    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        buf = loss.detach().float().reshape(1).clone()
        dist.broadcast(buf, group=self.group, group_src=self.last_rank)
        return buf[0]

    def _broadcast_tree(self, value: Any) -> Any:
        """Broadcast a pytree of tensors from the last-stage rank to every pp rank."""
        me_src = self.pp_rank == self.last_rank
        meta: list[Any] = [None]
        if me_src:
            leaves, spec = pytree.tree_flatten(value)
            meta = [(pytree.treespec_dumps(spec),
                     [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("obj", t) for t in leaves])]
        obj_device = self.device if self.device.type != "cpu" else None
        dist.broadcast_object_list(meta, group=self.group, group_src=self.last_rank, device=obj_device)
        spec_text, descr = meta[0]
        spec = pytree.treespec_loads(spec_text)
        out = []
        src_leaves = pytree.tree_leaves(value) if me_src else [None] * len(descr)
        for d, leaf in zip(descr, src_leaves):
            if d[0] == "obj":
                out.append(d[1])
                continue
            buf = leaf.detach().contiguous() if me_src else torch.empty(d[0], dtype=d[1], device=self.device)
            dist.broadcast(buf, group=self.group, group_src=self.last_rank)
            out.append(buf)
        return pytree.tree_unflatten(out, spec)
