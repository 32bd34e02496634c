"""Batch conventions under parallel layouts (gloo, CPU): a Hugging Face dict batch (``labels`` aligned with
``input_ids``) gives transformers' own loss under tp=2; a packed batch of the package's Llama or GPT-2 (``position_ids``
restarting per document) gives, under tp=2 × pp=2, the single-process packed loss, which is the token-weighted
loss of its documents run one by one, and differs without the positions."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_4d.testing import run_world

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Losses of one fp32 model under two layouts differ by the rounding of split reductions: a few ulps of O(1)
# values; 1e-5 relative is ~100 fp32 eps, far below the 6e-4 relative that attention across documents changes.
RTOL = 1e-5
SEQ = 16


def _trainer(strategy: dict[str, Any], devices: int, **kwargs: Any) -> L.Trainer:
    from lightning_4d import FourDStrategy

    return L.Trainer(accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                     strategy=FourDStrategy(**strategy, timeout=timedelta(seconds=60)), enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _hf_dict_loss(rank: int) -> float:
    from tests.unit.test_batches import hf_batch, tiny_hf_lm

    lm = tiny_hf_lm()
    trainer = _trainer(dict(tp=2), 2)
    return trainer.validate(lm, DataLoader([hf_batch()], batch_size=None), verbose=False)[0]["val_loss"]


def test_hf_dict_batch_loss_under_tp() -> None:
    pytest.importorskip("transformers")
    from tests.unit.test_batches import hf_batch, tiny_hf_lm

    lm, batch = tiny_hf_lm(), hf_batch()
    with torch.no_grad():
        reference = lm.model.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss.item()
    for value in run_world(_hf_dict_loss, 2, pg_timeout_s=60, timeout_s=300):
        assert abs(value - reference) <= RTOL * abs(reference), (value, reference)


def packed_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """4 rows (2 micro-batches under pp=2) of SEQ tokens packed from documents of different lengths."""
    gen = torch.Generator().manual_seed(3)
    rows = ((5, 7, 4), (16,), (3, 3, 10), (9, 7))
    xs, ys, ps, docs = [], [], [], []
    for lengths in rows:
        row = [torch.randint(0, 64, (n,), generator=gen) for n in lengths]
        xs.append(torch.cat(row))
        ys.append(torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in row]))
        ps.append(torch.cat([torch.arange(n) for n in lengths]))
        docs.append(row)
    return torch.stack(xs), torch.stack(ys), torch.stack(ps), docs


def _lm(kind: str):
    """``CausalLM`` around the package's ``kind`` model, or (``transformers``) a transformers Llama in ``HFLogits``."""
    from lightning_4d.models import CausalLM, HFLogits
    from tests.distributed.common import build_model
    from tests.hf_tiny import tiny_config

    torch.manual_seed(0)
    if kind == "transformers":
        return CausalLM(HFLogits.from_config(tiny_config("llama", 64), attn_implementation="sdpa"), lr=1e-3)
    return CausalLM(build_model(kind), lr=1e-3)


class _TrainLoss(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _packed_world(rank: int, kind: str) -> dict[str, float]:
    x, y, pos, _ = packed_rows()
    record = _TrainLoss()
    trainer = _trainer(dict(tp=2, pp=2), 4, max_steps=1, callbacks=[record])
    lm = _lm(kind)
    packed = trainer.validate(lm, DataLoader([(x, y, pos)], batch_size=None), verbose=False)[0]["val_loss"]
    crossing = trainer.validate(lm, DataLoader([(x, y)], batch_size=None), verbose=False)[0]["val_loss"]
    trainer.fit(lm, DataLoader([(x, y, pos)], batch_size=None))
    return {"packed": packed, "crossing": crossing, "train": record.losses[0]}


@pytest.mark.parametrize("kind", ["llama", "gpt2", "hf", "transformers"])
def test_packed_batch_under_tp_and_pp(kind: str) -> None:
    if kind == "transformers":
        pytest.importorskip("transformers")
    from tests.unit.test_packing import one_by_one

    x, y, pos, docs = packed_rows()
    lm = _lm(kind)
    with torch.no_grad():
        single = lm.fourd_loss((x, y, pos)).item()
        reference = one_by_one(lm, y, docs)
    assert abs(single - reference) <= RTOL * abs(reference), (single, reference)
    for got in run_world(_packed_world, 4, kind, pg_timeout_s=60, timeout_s=540):
        for name in ("packed", "train"):
            assert abs(got[name] - reference) <= RTOL * abs(reference), (name, got, reference)
        assert abs(got["crossing"] - reference) > 10 * RTOL * abs(reference), (got, reference)
