"""Metrics are right under every layout: ``torchmetrics`` metrics under tp=2 × pp=2 × dp=2 (8 CPU ranks), and under
a V-shaped pipeline schedule (zbv: the last stage on the first rank), equal one process's values.

Each world validates a tiny Llama (:class:`~lightning_4d.models.CausalLM` plus metrics a user would write: created in
``setup`` with ``process_group=self.fourd_dp_group``, updated in ``loss_fn`` when ``fourd_stage == "val"``, logged
with ``fourd_log_metric``); the same module validates in the test process without the strategy. Checked:

- counts and accuracies (``CausalLM``'s ``val_acc``, torchmetrics' ``MulticlassAccuracy`` and ``SumMetric``) are
  *exactly* the single-process values, on every rank (also those without outputs), and logged bit for bit;
- the perplexity ``val_ppl`` agrees within 1e-6 relative (the per-token losses of a tensor-parallel model differ
  from one process's by float rounding, so no float can be exact);
- the same metric synced over the world (torchmetrics' default) counts every token ``tp`` times — the bug the group
  fixes, shown so this test can tell right from wrong — and ``fourd_log_metric`` refuses it on every rank;
- ``fourd_holds_outputs`` is true on exactly the last stage's ranks; ``token_predictions`` on vocabulary-sharded
  logits (uneven shards, ties across shards) equals ``argmax`` of the full logits.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_4d import FourDStrategy
from lightning_4d.core.metrics import token_predictions
from lightning_4d.models import CausalLM
from lightning_4d.testing import run_world
from tests.distributed.common import VOCAB, build_model, make_dataset

torchmetrics = pytest.importorskip("torchmetrics")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# name -> (model, world, strategy options, which ranks hold the outputs)
LAYOUTS: dict[str, tuple[str, int, dict[str, Any], list[bool]]] = {
    # (pp, dp, tp) rank order, tp innermost: the last stage (1F1B: pp rank 1) is ranks 4..7.
    "tp2-pp2-dp2": ("llama", 8, {"tp": 2, "pp": 2}, [False] * 4 + [True] * 4),
    # V-shaped placement: stages 0 and 3 on pp rank 0, so the last stage is on the first rank.
    "pp2-zbv": ("llama-4", 2, {"pp": 2, "schedule": "zbv"}, [True, False]),
}
GLOBAL_BATCH, SAMPLES = 8, 32
PPL_TOL = 1e-6  # fp32 per-token losses under tp differ by a few ulps; summed in float64


class MetricLM(CausalLM):
    """CausalLM's own metrics plus what a user writes with the mixin's accessors."""

    def setup(self, stage: str) -> None:
        from torchmetrics.aggregation import SumMetric
        from torchmetrics.classification import MulticlassAccuracy

        group = self.fourd_dp_group
        self.user_acc = MulticlassAccuracy(VOCAB, average="micro", ignore_index=-100, process_group=group)
        self.user_tokens = SumMetric(process_group=group)
        self.world_tokens = SumMetric()  # torchmetrics' default group (the world): wrong under tp / pp
        self.seen: list[str] = []
        self.report: dict[str, Any] = {}

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.fourd_stage == "val":
            self.seen.append(type(logits).__name__ + str(getattr(logits, "placements", "")))
            preds = token_predictions(logits)
            self.user_acc.update(preds, targets)
            valid = (targets != -100).sum().float()
            self.user_tokens.update(valid)
            self.world_tokens.update(valid)
        return super().loss_fn(logits, targets)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        self.report["user_acc"] = float(self.fourd_log_metric("user_acc", self.user_acc))
        self.report["user_tokens"] = float(self.fourd_log_metric("user_tokens", self.user_tokens))
        strategy = self.trainer.strategy
        if isinstance(strategy, FourDStrategy):
            try:
                self.fourd_log_metric("world_tokens", self.world_tokens)
            except ValueError as err:  # raised on every rank, before any collective
                self.report["refusal"] = str(err)
            self.report["world_tokens"] = float(self.world_tokens.compute())  # every rank: a world all-gather
        self.world_tokens.reset()


def validate(layout: str, in_world: bool) -> dict[str, Any]:
    kind, world, options, _ = LAYOUTS[layout]
    torch.manual_seed(0)
    lm = MetricLM(build_model(kind))
    strategy: Any = FourDStrategy(**options) if in_world else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world if in_world else 1, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    dp = world // (options.get("tp", 1) * options.get("pp", 1)) if in_world else 1
    batch = GLOBAL_BATCH // dp
    logged = trainer.validate(lm, DataLoader(make_dataset(SAMPLES, seed=5), batch_size=batch), verbose=False)[0]
    out = {"logged": {k: float(v) for k, v in logged.items()}, **lm.report, "seen": sorted(set(lm.seen)),
           "holds": lm.fourd_holds_outputs}
    if in_world and options.get("tp", 1) > 1:
        out["sharded_argmax"] = _sharded_argmax_cases(trainer.strategy.mesh)
    return out


def _sharded_argmax_cases(mesh: Any) -> list[bool]:
    """``token_predictions`` of vocabulary-sharded DTensors equals ``argmax`` of the full tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = mesh.dense["tp"]
    gen = torch.Generator().manual_seed(3)
    cases = []
    for vocab in (7, 8, 64):  # uneven and even shards
        full = torch.randint(0, 3, (2, 5, vocab), generator=gen).float()  # many ties, also across shards
        full[0, 0, :] = 1.0  # all equal: index 0
        full[1, 4, -1] = 9.0  # maximum in the last shard
        cases.append(torch.equal(token_predictions(distribute_tensor(full, tp, [Shard(2)])), full.argmax(-1)))
    return cases


def _world(rank: int, layout: str) -> dict[str, Any]:
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    return validate(layout, in_world=True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_torchmetrics_equal_one_process(layout: str) -> None:
    _, world, options, holds = LAYOUTS[layout]
    tp = options.get("tp", 1)
    ranks = run_world(_world, world, layout, timeout_s=420, pg_timeout_s=120)
    ref = validate(layout, in_world=False)
    assert [r["holds"] for r in ranks] == holds
    assert all(bool(r["seen"]) == h for r, h in zip(ranks, holds))  # loss_fn ran where the outputs are, only there
    if tp > 1:  # the logits loss_fn saw were sharded over the vocabulary; the argmax over shards is exact
        assert all(all("Shard(dim=2)" in s for s in r["seen"]) for r, h in zip(ranks, holds) if h), ranks[-1]["seen"]
        assert all(r["sharded_argmax"] == [True, True, True] for r in ranks)
    first = ranks[0]
    for r in ranks:  # every rank logs the same numbers, and logs what it computed
        assert r["logged"] == first["logged"]
        assert r["logged"]["user_acc"] == r["user_acc"] and r["logged"]["user_tokens"] == r["user_tokens"]
    got, want = first["logged"], ref["logged"]
    assert want["user_tokens"] > 0 and 0 < want["val_acc"] < 1
    # Integer states: exact.
    assert got["user_tokens"] == want["user_tokens"], (got, want)
    assert got["val_acc"] == want["val_acc"] == want["user_acc"] == got["user_acc"], (got, want)
    # Float states: within rounding.
    assert abs(got["val_ppl"] / want["val_ppl"] - 1) <= PPL_TOL, (got["val_ppl"], want["val_ppl"])
    assert abs(got["val_loss"] / want["val_loss"] - 1) <= 1e-5
    # The world group counts each token once per tensor-parallel rank of the last stage (tp times) and is refused.
    assert all(r["world_tokens"] == tp * want["user_tokens"] for r in ranks)
    assert all("process_group=self.fourd_dp_group" in r["refusal"] for r in ranks), first.get("refusal")
