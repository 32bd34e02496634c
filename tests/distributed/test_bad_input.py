"""Unbatched inputs get a clear error on every rank before any collective of the step (not a raw error from
inside DTensor or pipeline code)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_4d.testing import run_world


def _fit_unbatched(rank: int, strategy: dict[str, Any]) -> str:
    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model, make_dataset

    torch.manual_seed(0)
    lm = CausalLM(build_model("llama"), lr=1e-3)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                        strategy=FourDStrategy(**strategy, timeout=timedelta(seconds=30)), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(lm, DataLoader(make_dataset(8), batch_size=None))  # one (T,) sample per step
    except ValueError as err:
        return str(err)
    return "no error"


def test_unbatched_inputs_fail_clearly_on_every_rank() -> None:
    for strategy in (dict(tp=2), dict(pp=2)):
        for message in run_world(_fit_unbatched, 2, strategy, pg_timeout_s=30, timeout_s=120):
            assert message.startswith("inputs of shape (16,) have 1 dimension(s), but the model was set up with "
                                      "inputs of 2"), (strategy, message)
            assert "DataLoader with batch_size" in message, message
