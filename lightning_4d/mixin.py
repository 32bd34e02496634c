"""``FourDModule``: default Lightning steps that work unchanged for every layout.

Example:
    >>> import lightning as L, torch.nn.functional as F
    >>> class MyLM(FourDModule, L.LightningModule):
    ...     def __init__(self, model):
    ...         super().__init__()
    ...         self.model = model
    ...     def forward(self, tokens):
    ...         return self.model(tokens)
    ...     def loss_fn(self, logits, targets):
    ...         return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import Tensor

from lightning_4d import _compat
from lightning_4d.core.batches import batch_tokens, call_model, split_batch
from lightning_4d.core.loss import count_targets
from lightning_4d.mesh import Axis

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.optim import Optimizer
    from torchmetrics import Metric

    from lightning_4d.strategy import FourDStrategy

__all__ = ["FourDModule"]


def _last_stage_rank(strategy: FourDStrategy) -> int:
    """The pp rank of the last pipeline stage, as the pipeline runner placed it (its ``last_rank``)."""
    plan = strategy.plan
    assert plan is not None and plan.pipeline is not None, "pp > 1: the strategy built a pipeline runner"
    return plan.pipeline.last_rank


class FourDModule:
    """Mixin for a ``LightningModule`` (put it first: ``class M(FourDModule, L.LightningModule)``).

    Batches are ``(inputs, targets)`` (targets already shifted), or a dict with ``inputs``/``input_ids`` and
    either ``targets`` (already shifted) or ``labels`` (Hugging Face: aligned with the inputs, shifted here, ``-100``
    ignored), optionally ``position_ids`` for packed documents (see :mod:`lightning_4d.core.batches`). The loss is
    ``loss_fn(forward(inputs), targets)``; the value returned and logged (``train_loss``, ``val_loss``,
    ``test_loss``) is the global-batch mean on every rank, weighted by the number of valid targets
    (``ignore_index`` excluded).

    Hooks to override: ``loss_fn`` (required), ``split_batch``, ``count_targets``,
    ``fourd_blocks_path`` (where the repeated blocks are), ``fourd_tp_plan`` (an explicit
    tensor-parallel plan). Under any other strategy the steps compute the plain loss, so the same
    module is its own single-process reference.

    Metrics (``torchmetrics``) that are right under every layout: create them with
    ``process_group=self.fourd_dp_group`` (in ``setup``, when the groups exist), update them in ``loss_fn``
    when :attr:`fourd_stage` is ``"val"`` (it runs where the outputs are: the last pipeline stage, once per
    micro-batch) and log them with :meth:`fourd_log_metric` at the epoch's end::

        def setup(self, stage):
            self.val_acc = MulticlassAccuracy(V, average="micro", process_group=self.fourd_dp_group)
        def loss_fn(self, logits, targets):
            if self.fourd_stage == "val":
                self.val_acc.update(token_predictions(logits), targets)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        def on_validation_epoch_end(self):
            self.fourd_log_metric("val_acc", self.val_acc)

    Example:
        >>> FourDModule.ignore_index
        -100
    """

    ignore_index: Optional[int] = -100
    _fourd_stage: Optional[str] = None

    # ------------------------------------------------------------------ user hooks
    def loss_fn(self, outputs: Any, targets: Any) -> Tensor:
        """Mean loss of ``outputs`` against ``targets``; runs on the last pipeline stage."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `loss_fn(self, outputs, targets)` returning the mean loss, e.g. "
            f"`F.cross_entropy(outputs.flatten(0, 1), targets.flatten())`."
        )

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """Return ``(inputs, targets)`` from a batch, targets shifted (:func:`lightning_4d.core.batches.split_batch`):
        ``(inputs, targets)`` as they are; a dict's ``labels`` (Hugging Face, aligned with the inputs) shifted here;
        ``position_ids`` (packed documents) make the inputs :class:`~lightning_4d.core.batches.PackedInputs`."""
        return split_batch(batch, self.ignore_index if self.ignore_index is not None else -100)

    def count_targets(self, targets: Any) -> Tensor:
        """How many elements ``loss_fn`` averages over (weights the global mean)."""
        return count_targets(targets, self.ignore_index)

    # ------------------------------------------------------------------ steps
    def _fourd_strategy(self) -> Optional[FourDStrategy]:
        from lightning_4d.strategy import FourDStrategy

        trainer = _compat.attached_trainer(self)
        strategy = trainer.strategy if trainer is not None else None
        return strategy if isinstance(strategy, FourDStrategy) else None

    def fourd_loss(self, batch: Any, stage: str = "train") -> Tensor:
        """The global-batch loss of ``batch`` (differentiable in training).

        Example:
            >>> import lightning as L, torch.nn.functional as F
            >>> class Net(FourDModule, L.LightningModule):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.lin = torch.nn.Linear(4, 3)
            ...     def forward(self, x):
            ...         return self.lin(x)
            ...     def loss_fn(self, out, y):
            ...         return F.cross_entropy(out, y)
            >>> net, x, y = Net(), torch.ones(2, 4), torch.tensor([0, 2])
            >>> bool(net.fourd_loss((x, y)) == F.cross_entropy(net(x), y))  # no FourDStrategy: the plain loss
            True
        """
        inputs, targets = self.split_batch(batch)
        strategy = self._fourd_strategy()
        previous, self._fourd_stage = self._fourd_stage, stage
        try:
            if strategy is None:
                return self.loss_fn(call_model(self, inputs), targets)
            return strategy.compute_loss(self, inputs, targets, stage)
        finally:
            self._fourd_stage = previous

    # ------------------------------------------------------------------ metrics
    @property
    def fourd_stage(self) -> Optional[str]:
        """``"train"``, ``"val"`` or ``"test"`` while :meth:`fourd_loss` runs (so inside ``loss_fn``: which
        metrics to update), else ``None``.

        Example:
            >>> FourDModule().fourd_stage is None
            True
        """
        return self._fourd_stage

    @property
    def fourd_dp_group(self) -> Optional[dist.ProcessGroup]:
        """The data-parallel process group, to pass as a ``torchmetrics`` metric's ``process_group=``: its states
        are then summed over the ranks holding *different* samples only (tensor-parallel and pipeline peers see
        the same ones; with context parallelism the group is ``dp × cp``: those ranks hold different tokens). ``None`` (torchmetrics' default: the world, right for DDP and one process) under other
        strategies. Exists once the Trainer has set up the processes (from ``setup`` on).

        Example:
            >>> FourDModule().fourd_dp_group is None  # no Trainer: one process
            True
        """
        strategy = self._fourd_strategy()
        if strategy is None:
            return None
        try:
            mesh = strategy.mesh
        except RuntimeError as err:
            raise RuntimeError(
                f"{type(self).__name__}.fourd_dp_group: the data-parallel group exists once the Trainer has set up "
                f"the processes. Create metrics in `setup(self, stage)` (or later), not in `__init__`."
            ) from err
        return mesh[Axis.DP_CP].get_group()  # dp × cp with context parallelism: ranks of different tokens

    @property
    def fourd_holds_outputs(self) -> bool:
        """Whether this rank computes the model's outputs and ``loss_fn``: every rank without pipeline parallelism,
        else the ranks of the last pipeline stage (all their tensor-parallel ranks). Metrics are updated there.

        Example:
            >>> FourDModule().fourd_holds_outputs
            True
        """
        strategy = self._fourd_strategy()
        if strategy is None or strategy.dims.pp == 1:
            return True
        return strategy.mesh.rank(Axis.PP) == _last_stage_rank(strategy)

    def _check_metric_group(self, name: str, metric: Metric, strategy: FourDStrategy) -> None:
        import torch.distributed as dist

        if strategy.dims.world_size == strategy.dims.dp:
            return  # data parallel only: the world is the data-parallel group
        group = getattr(metric, "process_group", None)
        want = dist.get_process_group_ranks(self.fourd_dp_group)
        have = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if have != want:
            raise ValueError(
                f"metric {name!r} ({type(metric).__name__}) syncs over ranks {have[:8]}{'…' if len(have) > 8 else ''} "
                f"but this rank's data-parallel group is {want}: tensor-parallel and pipeline peers hold the same "
                f"samples (counted tp·pp times) and ranks without outputs have nothing to add. Create it with "
                f"process_group=self.fourd_dp_group (in `setup`)."
            )

    def fourd_log_metric(self, name: str, metric: Metric, **log_kwargs: Any) -> Tensor:
        """Compute a ``torchmetrics`` metric where the outputs are, hand the value to every rank, log it and reset
        the metric; returns the value (equal on every rank). Call it on **every** rank at the end of an epoch
        (``on_validation_epoch_end``).

        The metric (created with ``process_group=self.fourd_dp_group``) is computed on the ranks holding the
        outputs (:attr:`fourd_holds_outputs`; its states are synced over the data-parallel group there) and
        broadcast from the last pipeline stage to the others. It is logged per epoch with ``sync_dist=True`` and
        ``reduce_fx="max"``, so the logged number is bit-for-bit the computed one. ``log_kwargs`` go to
        ``self.log`` (e.g. ``prog_bar=True``).

        Raises:
            ValueError: under ``FourDStrategy`` with tp or pp > 1, a metric that syncs over other ranks than the
                data-parallel group (e.g. ``process_group`` left at the world).

        Example:
            >>> # not run: needs a Trainer
            >>> self.fourd_log_metric("val_acc", self.val_acc, prog_bar=True)  # doctest: +SKIP
            tensor(0.4375)
        """
        import torch.distributed as dist

        strategy = self._fourd_strategy()
        holds = self.fourd_holds_outputs
        if strategy is not None:  # on every rank, before any collective
            self._check_metric_group(name, metric, strategy)
        value = torch.as_tensor(metric.compute(), dtype=torch.float64).reshape(()) if holds else None
        metric.reset()
        if strategy is not None and strategy.dims.pp > 1:
            buf = value.detach().clone() if value is not None else torch.zeros((), dtype=torch.float64)
            buf = buf.to(strategy.root_device)
            dist.broadcast(buf, group=strategy.mesh[Axis.PP].get_group(), group_src=_last_stage_rank(strategy))
            value = buf
        assert value is not None
        options = {"on_step": False, "on_epoch": True, "sync_dist": True, "reduce_fx": "max", **log_kwargs}
        self.log(name, value.float(), **options)  # type: ignore[attr-defined]
        return value.float()

    def _log_loss(self, name: str, loss: Tensor, batch: Any, on_step: bool) -> None:
        inputs = batch_tokens(self.split_batch(batch)[0])
        size = inputs.shape[0] if isinstance(inputs, Tensor) else None
        # The value is already global and equal on every rank. An epoch-level value is still marked
        # sync_dist (one all-reduce of a scalar per epoch, the mean of equal values): Lightning warns otherwise.
        self.log(name, loss.detach(), prog_bar=True, on_step=on_step, on_epoch=not on_step, batch_size=size,
                 sync_dist=not on_step)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """``loss_fn(forward(inputs), targets)``, logged as ``train_loss``."""
        loss = self.fourd_loss(batch, "train")
        self._log_loss("train_loss", loss, batch, on_step=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Forward-only loss, logged as ``val_loss`` (epoch mean)."""
        loss = self.fourd_loss(batch, "val")
        self._log_loss("val_loss", loss, batch, on_step=False)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Forward-only loss, logged as ``test_loss`` (epoch mean)."""
        loss = self.fourd_loss(batch, "test")
        self._log_loss("test_loss", loss, batch, on_step=False)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """The full model outputs for the batch's inputs, on every rank."""
        inputs = self.split_batch(batch)[0] if isinstance(batch, (tuple, list, dict)) else batch
        strategy = self._fourd_strategy()
        if strategy is None:
            return call_model(self, inputs)
        return strategy.predict(self, inputs)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Optimizer) -> None:
        """Lightning zeroes gradients after ``training_step``; under a pipeline they were computed
        inside it, so the strategy zeroes them before the schedule runs instead."""
        strategy = self._fourd_strategy()
        if strategy is not None and strategy.plan is not None and strategy.plan.pipeline is not None:
            return
        optimizer.zero_grad()

    def clip_gradients(self, optimizer: Optimizer,
                       gradient_clip_val: Optional[Union[int, float]] = None,
                       gradient_clip_algorithm: Optional[str] = None) -> None:
        """Clip by the global norm across all shards under ``FourDStrategy`` (else Lightning's)."""
        strategy = self._fourd_strategy()
        algorithm = str(gradient_clip_algorithm or "norm")
        if strategy is None or gradient_clip_val is None or gradient_clip_val <= 0 or "value" in algorithm:
            return super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[misc]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        strategy.clip_grad_norm_(params, float(gradient_clip_val))
