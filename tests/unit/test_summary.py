"""FourDModelSummary prints the whole model's counts (what FourDStrategy counted before splitting)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from torch.utils.data import DataLoader

from lightning_4d.callbacks.summary import FourDModelSummary, use_whole_model_summary


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 3)  # 9 parameters on "this stage"

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.lin(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_totals_and_rows_are_the_whole_models(tmp_path, monkeypatch) -> None:
    printed: dict[str, Any] = {}

    def capture(data: list, total: int, trainable: int, size: float, modes: dict, **kw: Any) -> None:
        printed.update(data=dict(data), total=total, trainable=trainable, size=size)

    monkeypatch.setattr(ModelSummary, "summarize", staticmethod(capture))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[FourDModelSummary()], default_root_dir=tmp_path)
    # What FourDStrategy records before the pipeline split (here: a model 4x this rank's share).
    trainer.strategy.parameter_counts = (36, 30)
    trainer.strategy.module_parameter_counts = {"lin": 36}
    trainer.fit(_Tiny(), DataLoader(torch.ones(4, 2), batch_size=2))
    assert (printed["total"], printed["trainable"]) == (36, 30)
    assert [p.strip() for p in printed["data"]["Params"]] == ["36"]
    assert abs(printed["size"] - 36 * 4 / 1e6) < 1e-12  # fp32: 4 bytes per parameter, Lightning's MB


def test_lightnings_default_summary_is_swapped() -> None:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[RichModelSummary(max_depth=2)])
    use_whole_model_summary(trainer)
    (summary,) = [cb for cb in trainer.callbacks if isinstance(cb, ModelSummary)]
    assert isinstance(summary, FourDModelSummary) and summary.rich and summary.max_depth == 2
