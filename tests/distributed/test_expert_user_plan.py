"""A user's tensor-parallel plan under expert parallelism: the tokens an MoE layer sees must be sequence shards.

With ``tp > 1`` and ``ep > 1`` every expert sums the contributions of the tokens of all TP ranks, which is only
the single-process gradient when those ranks hold *different* tokens (sequence shards). A ``fourd_tp_plan`` that
keeps the sequence whole into an MoE layer would route every token ``tp`` times and scale the expert gradients by
``tp`` — so the first forward checks it and fails on every rank with a message, never trains on.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from lightning_4d.models.lm import CausalLM
from lightning_4d.testing import run_world
from tests.distributed.common import make_dataset
from tests.distributed.moe_models import build_moe_model

os.environ.setdefault("OMP_NUM_THREADS", "1")


class WholeSequencePlan(CausalLM):
    """Megatron-style attention TP without sequence parallelism: the MoE layers see the full sequence."""

    def fourd_tp_plan(self, tp_mesh: Any, sequence_parallel: bool) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {}
        for i, block in enumerate(self.model.layers):
            attn = f"model.layers.{i}.attention"
            plan.update({f"{attn}.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
            plan[f"{attn}.wo"] = RowwiseParallel()
            block.attention.n_heads //= tp_mesh.size()
            block.attention.n_kv_heads //= tp_mesh.size()
        return plan


def _fit_whole_sequence(rank: int) -> str:
    torch.manual_seed(0)
    lm = WholeSequencePlan(build_moe_model(), lr=1e-3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FourDStrategy(tp=2, ep=2, timeout=timedelta(seconds=30)),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(lm, DataLoader(make_dataset(8), batch_size=8))
    except ValueError as err:
        return str(err)
    return "no error"


def _token_check(rank: int) -> list[str]:
    """Drive the check directly: different tokens pass, identical tokens and DTensors fail (on every rank)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_4d.expert_parallel.parallel import install_token_shard_check

    group = dist.group.WORLD
    out = []
    for tokens, kind in ((torch.full((3, 4), float(rank)), "shards"), (torch.ones(3, 4), "replicated"),
                         (None, "dtensor")):
        layer = nn.Identity()
        install_token_shard_check({"layers.0.moe": layer}, group)
        if tokens is None:
            mesh = init_device_mesh("cpu", (2,))
            tokens = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)])
        try:
            layer(tokens)
            layer(tokens)  # the check runs once: the second call is free
            out.append(f"{kind}: ok")
        except ValueError as err:
            out.append(f"{kind}: {err}")
    return out


def test_user_plan_that_keeps_the_sequence_whole_fails_loudly() -> None:
    results = run_world(_fit_whole_sequence, 2, timeout_s=300, pg_timeout_s=30)
    for message in results:
        assert "sees the same tokens" in message and "does not split the sequence" in message, message
        assert "layers.1.feed_forward" in message or "layers.0.feed_forward" in message, message


def test_token_shard_check_decides_alike_on_every_rank() -> None:
    results = run_world(_token_check, 2, timeout_s=120, pg_timeout_s=30)
    for per_rank in results:
        assert per_rank[0] == "shards: ok", per_rank
        assert "sees the same tokens ((3, 4)) on all 2 TP ranks" in per_rank[1], per_rank
        assert "receives a DTensor" in per_rank[2], per_rank
