"""``CausalLM``: a ready ``FourDModule`` that trains any next-token model with cross-entropy + AdamW.

Example:
    >>> from lightning_4d.models import Llama, LlamaConfig
    >>> lm = CausalLM(Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4)))
    >>> lm.loss_fn(torch.zeros(1, 3, 64), torch.zeros(1, 3, dtype=torch.long)).item() > 0
    True
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_4d.mixin import FourDModule

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import OptimizerLRScheduler
    from torchmetrics import Metric

__all__ = ["CausalLM"]


class CausalLM(FourDModule, L.LightningModule):
    """Wraps a model mapping tokens ``(B, T)`` to logits ``(B, T, V)``.

    Batches: ``(inputs, targets)`` with targets already shifted (the package's data modules), or Hugging Face dicts
    ``{"input_ids", "labels"}`` with labels aligned with the inputs (shifted once at batch entry, ``-100``
    ignored: the loss is transformers' own), optionally with ``position_ids`` of packed documents (attention then
    stays within each document). See :mod:`lightning_4d.core.batches`.

    Validation and test log, besides ``val_loss`` / ``test_loss``, the token-weighted perplexity ``val_ppl`` and
    the next-token accuracy ``val_acc`` (``test_ppl``, ``test_acc``) of every target token that is not
    ``ignore_index``, through ``torchmetrics`` (:mod:`lightning_4d.core.metrics`): updated in ``loss_fn`` where the
    outputs are, synced over the data-parallel group, equal on every rank and to one process's values.

    Args:
        model: the network (its forward must be ``tokens -> logits``).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear warm-up steps of the LR (0: none).
        metrics: log perplexity and accuracy in validation and test.
        schedule: after the warm-up, ``constant``, ``cosine`` or ``linear`` decay to ``min_lr_ratio · lr``
            (:mod:`lightning_4d.models.lr_schedule`).
        decay_steps: the optimizer step where the decay reaches its floor (``None``: the run's length,
            ``trainer.estimated_stepping_batches``, i.e. ``max_steps`` when set).
        min_lr_ratio: the floor of the decay, a share of ``lr``.

    Example:
        >>> lm = CausalLM(nn.Sequential(nn.Embedding(8, 8)), lr=1e-3)
        >>> lm.hparams.lr
        0.001
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        metrics: bool = True,
        schedule: str = "constant",
        decay_steps: Optional[int] = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        from lightning_4d.models.lr_schedule import check_schedule

        check_schedule(schedule, warmup_steps, decay_steps, min_lr_ratio)
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        # stage -> {"ppl": TokenPerplexity, "acc": TokenAccuracy}. A plain dict, not submodules: the metrics stay out
        # of the model the strategy rewrites (trace, pipeline split, precision casts, checkpoints).
        self._metrics: dict[str, dict[str, Metric]] = {}

    def forward(self, tokens: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """Logits ``(B, T, V)`` for tokens ``(B, T)``; ``position_ids`` ``(B, T)`` (packed documents, restarting at 0
        where a document starts) are passed on to the model, which then attends within each document only."""
        if position_ids is None:
            return self.model(tokens)
        if "position_ids" not in inspect.signature(self.model.forward).parameters:
            raise ValueError(
                f"a packed batch (with position_ids) but {type(self.model).__name__}.forward takes no position_ids, "
                f"so its attention would cross document boundaries. Use a model that takes them (Llama, HFLogits) "
                f"or batches without position_ids (pack=False).")
        return self.model(tokens, position_ids=position_ids)

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy over targets that are not ``ignore_index``; in validation and test it also
        updates the perplexity and accuracy metrics with this (micro-)batch.

        ``targets`` are shifted (``targets[:, t]`` is the token after ``inputs[:, t]``): the mixin turns Hugging Face
        ``labels`` (aligned with the inputs) into such targets at batch entry, so a dict batch with ``labels`` gives
        transformers' own ``model(input_ids, labels=labels).loss`` (see :mod:`lightning_4d.core.batches`)."""
        ignore = self.ignore_index if self.ignore_index is not None else -100
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore)
        stage = self.fourd_stage
        if stage in ("val", "test") and self.hparams.get("metrics", True):
            self._update_metrics(stage, logits, targets, loss, ignore)
        return loss

    def stage_metrics(self, stage: str) -> dict[str, Metric]:
        """The ``torchmetrics`` metrics of ``stage`` (``"val"`` or ``"test"``): ``{"ppl": TokenPerplexity,
        "acc": TokenAccuracy}``, created on first use with ``process_group=self.fourd_dp_group``.

        Example:
            >>> sorted(CausalLM(nn.Linear(2, 2)).stage_metrics("val"))
            ['acc', 'ppl']
        """
        if stage not in self._metrics:
            from lightning_4d.core.metrics import TokenAccuracy, TokenPerplexity

            group = self.fourd_dp_group
            ignore = self.ignore_index if self.ignore_index is not None else -100
            with torch.inference_mode(False):  # plain tensors: updated inside and outside inference mode
                self._metrics[stage] = {"ppl": TokenPerplexity(process_group=group),
                                        "acc": TokenAccuracy(ignore_index=ignore, process_group=group)}
        return self._metrics[stage]

    @torch.no_grad()
    def _update_metrics(self, stage: str, logits: Tensor, targets: Tensor, loss: Tensor, ignore: int) -> None:
        from lightning_4d.core.metrics import local_value, token_predictions

        metrics = self.stage_metrics(stage)
        for metric in metrics.values():
            if metric.device != targets.device:
                metric.to(targets.device)
        count = (targets != ignore).sum()
        if int(count):
            metrics["ppl"].update(local_value(loss).detach().double() * count, count)
        metrics["acc"].update(token_predictions(logits), targets)

    def _log_metrics(self, stage: str) -> None:
        if not self.hparams.get("metrics", True):
            return
        metrics = self.stage_metrics(stage)  # also on ranks without outputs: they take part in the broadcast
        self.fourd_log_metric(f"{stage}_ppl", metrics["ppl"])
        self.fourd_log_metric(f"{stage}_acc", metrics["acc"])

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_metrics"] = {}  # their process groups cannot be pickled or copied; recreated on first use
        return state

    @override
    def on_validation_epoch_end(self) -> None:
        """Log ``val_ppl`` and ``val_acc`` (equal on every rank), then reset them."""
        self._log_metrics("val")

    @override
    def on_test_epoch_end(self) -> None:
        """Log ``test_ppl`` and ``test_acc`` (equal on every rank), then reset them."""
        self._log_metrics("test")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record a wrapped Hugging Face model's config (:class:`~lightning_4d.models.HFLogits`), so
        ``python -m lightning_4d.checkpoint export-hf`` rebuilds it without ``--base``."""
        from lightning_4d.models.hf import CHECKPOINT_KEY, checkpoint_record

        record = checkpoint_record(self)
        if record is not None:
            checkpoint[CHECKPOINT_KEY] = record

    def configure_optimizers(self) -> OptimizerLRScheduler:
        """AdamW with fused kernels (``foreach`` where the device has none), one parameter group per device mesh and
        placements (:func:`~lightning_4d.core.optim.mesh_param_groups`: a fused call takes one mesh), with the
        learning-rate schedule: linear warm-up, then constant or a cosine / linear decay
        (:class:`~lightning_4d.models.lr_schedule.WarmupDecay`, stepped every optimizer step). A decay without
        ``decay_steps`` ends with the run, so without a Trainer attached (the planner's dry run tracing one step) the
        optimizer alone is returned."""
        from lightning_4d.core.optim import fast_kernel, mesh_param_groups
        from lightning_4d.models.lr_schedule import WarmupDecay

        hp = self.hparams
        params = list(self.parameters())
        opt = torch.optim.AdamW(mesh_param_groups(params), lr=hp.lr, weight_decay=hp.weight_decay,
                                betas=tuple(hp.betas), **fast_kernel(params))
        schedule = hp.get("schedule", "constant")
        if not hp.warmup_steps and schedule == "constant":
            return opt
        decay = hp.get("decay_steps")
        if decay is None and schedule != "constant":
            if self._trainer is None:  # e.g. the planner's dry run traces one step: the run's length is unknown
                return opt
            decay = self.trainer.estimated_stepping_batches
            if not math.isfinite(decay):
                raise ValueError(f"CausalLM(schedule={schedule!r}) decays over the run, whose length is unknown "
                                 f"(trainer max_steps=-1 and no epoch limit): pass decay_steps (optim.decay_steps).")
            decay = max(int(decay), hp.warmup_steps + 1)
        factor = WarmupDecay(schedule, hp.warmup_steps, decay if decay is not None else hp.warmup_steps + 1,
                             hp.get("min_lr_ratio", 0.1))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "name": "lr"}}

