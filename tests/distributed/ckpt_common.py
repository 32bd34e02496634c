"""Checkpoint test helpers: train, save, resume, and record the batches and losses seen."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from lightning_4d.models import CausalLM
from tests.distributed.common import build_model, make_dataset


class _Seen(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int, float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.seen.append((trainer.current_epoch, idx, int(batch[0].sum()), float(trainer.callback_metrics["train_loss"])))


def train(strategy: dict[str, Any], world: int, max_steps: int, ckpt_in: Optional[str] = None,
          save_to: Optional[str] = None, every_n: Optional[int] = None, ckpt_dir: Optional[str] = None,
          model: str = "llama", samples: int = 32, global_batch: int = 8, top_k: int = -1,
          extra_callbacks: Sequence[L.Callback] = ()) -> list[tuple[int, int, int, float]]:
    """One fit; returns (epoch, batch_idx, batch checksum, loss) per training batch on this rank (``top_k``: the
    ``ModelCheckpoint``'s ``save_top_k``)."""
    torch.manual_seed(0)
    lm = CausalLM(build_model(model), lr=1e-3)
    dp = world // (strategy.get("tp", 1) * strategy.get("pp", 1) * strategy.get("cp", 1))
    loader = DataLoader(make_dataset(samples), batch_size=global_batch // dp, drop_last=True)
    seen = _Seen()
    callbacks: list[Any] = [seen, *extra_callbacks]
    if every_n:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every_n,
                                                              save_top_k=top_k, filename="{step}"))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=FourDStrategy(**strategy), max_steps=max_steps,
                        logger=False, enable_checkpointing=bool(every_n), enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0)
    trainer.fit(lm, loader, ckpt_path=ckpt_in)
    if save_to:
        trainer.save_checkpoint(save_to)
    return seen.seen
