"""``CausalLM``: a ready ``FourDModule`` that trains any next-token model with cross-entropy + AdamW.

Example:
    >>> from lightning_4d.models import Llama, LlamaConfig
    >>> lm = CausalLM(Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4)))
    >>> lm.loss_fn(torch.zeros(1, 3, 64), torch.zeros(1, 3, dtype=torch.long)).item() > 0
    True
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_4d.mixin import FourDModule

__all__ = ["CausalLM"]


class CausalLM(FourDModule, L.LightningModule):
    """Wraps a model mapping tokens ``(B, T)`` to logits ``(B, T, V)``.

    Args:
        model: the network (its forward must be ``tokens -> logits``).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: linear warm-up steps of the LR (0 = constant LR).

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
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(B, T, V)`` for tokens ``(B, T)``."""
        return self.model(tokens)

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy over targets that are not ``ignore_index``."""
        ignore = self.ignore_index if self.ignore_index is not None else -100
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record a wrapped Hugging Face model's config (:class:`~lightning_4d.models.HFLogits`), so
        ``python -m lightning_4d.checkpoint export-hf`` rebuilds it without ``--base``."""
        from lightning_4d.models.hf import CHECKPOINT_KEY, checkpoint_record

        record = checkpoint_record(self)
        if record is not None:
            checkpoint[CHECKPOINT_KEY] = record

    def configure_optimizers(self) -> Any:
        """AdamW (per-tensor, so parameters on different meshes mix freely), optional linear warm-up."""
        hp = self.hparams
        opt = torch.optim.AdamW(
            self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas), foreach=False
        )
        if not hp.warmup_steps:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / hp.warmup_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

