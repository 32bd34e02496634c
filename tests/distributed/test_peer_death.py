"""A rank that dies mid-training is named in the survivors' error (rank, pid, host) with the collective they
were in, instead of only the transport's "Connection closed by peer [127.0.0.1]:port"."""

from __future__ import annotations

import os
import re
from typing import Any

import lightning as L

from lightning_4d.testing import run_world


class _DieAt(L.Callback):
    """Rank ``victim`` exits abruptly (as if killed) at the start of training batch ``step``."""

    def __init__(self, victim: int, step: int) -> None:
        self.victim, self.step = victim, step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_rank == self.victim and idx == self.step:
            os._exit(9)


def _train_and_die(rank: int, strategy: dict[str, Any], world: int) -> str:
    from datetime import timedelta

    import torch
    from torch.utils.data import DataLoader

    from lightning_4d import FourDStrategy
    from lightning_4d.models import CausalLM
    from tests.distributed.common import build_model, make_dataset

    torch.manual_seed(0)
    lm = CausalLM(build_model("llama"), lr=1e-3)
    dp = world // (strategy.get("tp", 1) * strategy.get("pp", 1))
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=4, logger=False, enable_checkpointing=False,
                        strategy=FourDStrategy(**strategy, timeout=timedelta(seconds=30)),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[_DieAt(victim=world - 1, step=1)])
    try:
        trainer.fit(lm, DataLoader(make_dataset(32), batch_size=8 // dp))
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_survivors_name_the_dead_rank_and_their_collective() -> None:
    for strategy, world in ((dict(), 2), (dict(tp=2), 2)):
        results = run_world(_train_and_die, world, strategy, world, raise_on_error=False, pg_timeout_s=30,
                            timeout_s=180)
        victim = world - 1
        assert not results[victim]["ok"]  # it exited
        for rank, r in enumerate(results[:victim]):
            message = r["value"] if r["ok"] else r["error"]
            first = message.splitlines()[0]
            assert re.search(rf"rank {rank}: a collective failed because a peer is gone: rank {victim} \(pid \d+ on "
                             rf"\S+\) has exited\. This rank was in torch\.distributed\.\w+", first), (strategy, message)
