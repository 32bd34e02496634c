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

from typing import Any, Optional

from torch import Tensor

from lightning_4d import _compat
from lightning_4d.loss import count_targets

__all__ = ["FourDModule"]

_INPUT_KEYS = ("inputs", "input_ids", "tokens", "x")
_TARGET_KEYS = ("targets", "labels", "y")


class FourDModule:
    """Mixin for a ``LightningModule`` (put it first: ``class M(FourDModule, L.LightningModule)``).

    Batches are ``(inputs, targets)`` or a dict with ``inputs``/``input_ids`` and
    ``targets``/``labels``. The loss is ``loss_fn(forward(inputs), targets)``; the value returned
    and logged (``train_loss``, ``val_loss``, ``test_loss``) is the global-batch mean on every
    rank, weighted by the number of valid targets (``ignore_index`` excluded).

    Hooks to override: ``loss_fn`` (required), ``split_batch``, ``count_targets``,
    ``fourd_blocks_path`` (where the repeated blocks are), ``fourd_tp_plan`` (an explicit
    tensor-parallel plan). Under any other strategy the steps compute the plain loss, so the same
    module is its own single-process reference.

    Example:
        >>> FourDModule.ignore_index
        -100
    """

    ignore_index: Optional[int] = -100

    # ------------------------------------------------------------------ user hooks
    def loss_fn(self, outputs: Any, targets: Any) -> Tensor:
        """Mean loss of ``outputs`` against ``targets``; runs on the last pipeline stage."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement `loss_fn(self, outputs, targets)` returning the mean loss, e.g. "
            f"`F.cross_entropy(outputs.flatten(0, 1), targets.flatten())`."
        )

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """Return ``(inputs, targets)`` from a batch (tuple/list of two, or a dict)."""
        if isinstance(batch, dict):
            inputs = next((batch[k] for k in _INPUT_KEYS if k in batch), None)
            targets = next((batch[k] for k in _TARGET_KEYS if k in batch), None)
            if inputs is None or targets is None:
                raise ValueError(
                    f"A dict batch needs an input key ({'/'.join(_INPUT_KEYS)}) and a target key "
                    f"({'/'.join(_TARGET_KEYS)}); got keys {sorted(batch)}. Override `split_batch`."
                )
            return inputs, targets
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        raise ValueError(
            f"A batch must be (inputs, targets) or a dict, got {type(batch).__name__}. Override `split_batch`."
        )

    def count_targets(self, targets: Any) -> Tensor:
        """How many elements ``loss_fn`` averages over (weights the global mean)."""
        return count_targets(targets, self.ignore_index)

    # ------------------------------------------------------------------ steps
    def _fourd_strategy(self) -> Any:
        from lightning_4d.strategy import FourDStrategy

        trainer = _compat.attached_trainer(self)
        strategy = trainer.strategy if trainer is not None else None
        return strategy if isinstance(strategy, FourDStrategy) else None

    def fourd_loss(self, batch: Any, stage: str = "train") -> Tensor:
        """The global-batch loss of ``batch`` (differentiable in training).

        Example:
            >>> loss = module.fourd_loss((inputs, targets))  # doctest: +SKIP
        """
        inputs, targets = self.split_batch(batch)
        strategy = self._fourd_strategy()
        if strategy is None:
            return self.loss_fn(self(inputs), targets)
        return strategy.compute_loss(self, inputs, targets, stage)

    def _log_loss(self, name: str, loss: Tensor, batch: Any, on_step: bool) -> None:
        inputs, _ = self.split_batch(batch)
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
            return self(inputs)
        return strategy.predict(self, inputs)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Lightning zeroes gradients after ``training_step``; under a pipeline they were computed
        inside it, so the strategy zeroes them before the schedule runs instead."""
        strategy = self._fourd_strategy()
        if strategy is not None and strategy.plan is not None and strategy.plan.pipeline is not None:
            return
        optimizer.zero_grad()

    def clip_gradients(self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None) -> None:
        """Clip by the global norm across all shards under ``FourDStrategy`` (else Lightning's)."""
        strategy = self._fourd_strategy()
        algorithm = str(gradient_clip_algorithm or "norm")
        if strategy is None or gradient_clip_val is None or gradient_clip_val <= 0 or "value" in algorithm:
            return super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[misc]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        strategy.clip_grad_norm_(params, float(gradient_clip_val))
