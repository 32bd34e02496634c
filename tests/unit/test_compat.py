"""Pins every private torch / Lightning name ``lightning_4d._compat`` relies on to the installed versions.

An upgrade that renames or removes one fails here, naming the symbol, instead of inside a training run.
"""

from __future__ import annotations

import importlib

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_4d import _compat

# (module, attribute path) of each private symbol used in lightning_4d/_compat.
PRIVATE_SYMBOLS = [
    ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning.pytorch.loops.fit_loop", "_FitLoop._should_accumulate"),
    ("torch.distributed.pipelining.schedules", "_wait_batch_p2p"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.forward_one_chunk"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.backward_one_chunk"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.backward_weight_one_chunk"),
    ("torch", "_foreach_norm"),
    ("torch", "_grouped_mm"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher"),
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"),
    ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    ("torch.distributed", "ProcessGroupGloo._Options"),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"),
    ("lightning.pytorch.callbacks", "ModelSummary._summary"),
    ("lightning.pytorch.utilities.model_summary", "ModelSummary._get_summary_data"),
    # lightning_4d/_compat/modules.py init_calls (a Hugging Face init_weights, module by module) and
    # dispatch.meta_scalar_mode (tracing on the meta device)
    ("transformers", "PreTrainedModel._initialize_weights"),
    ("transformers", "PreTrainedModel.is_custom_code"),
    ("transformers.initialization", "guard_torch_init_functions"),
    ("torch", "ops.aten._local_scalar_dense"),
    # lightning_4d/_compat/hf_saving.py (streamed export-hf: what save_pretrained drops and converts)
    ("transformers.modeling_utils", "remove_tied_weights_from_state_dict"),
    ("transformers.core_model_loading", "revert_weight_conversion"),
    # lightning_4d/_compat/hf_loading.py (pretrained weights streamed into shards: from_pretrained's key conversions)
    ("transformers.conversion_mapping", "get_model_conversion_mapping"),
    ("transformers.core_model_loading", "rename_source_key"),
    ("transformers.core_model_loading", "WeightConverter.add_tensor"),
    ("transformers.core_model_loading", "WeightConverter.convert"),
    ("transformers.core_model_loading", "WeightRenaming"),
    ("transformers.core_model_loading", "dot_natural_key"),
]


@pytest.mark.parametrize(("module", "path"), PRIVATE_SYMBOLS, ids=[f"{m}:{p}" for m, p in PRIVATE_SYMBOLS])
def test_private_symbol_exists(module: str, path: str) -> None:
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"{module}.{path} is gone in this version: update lightning_4d/_compat"
        obj = getattr(obj, part)


def test_lightning_private_instance_slots() -> None:
    module = L.LightningModule()  # instance attributes set in __init__
    assert hasattr(module, "_device_mesh") and hasattr(module, "_trainer")
    summary = L.pytorch.callbacks.ModelSummary(max_depth=2, foo=1)
    assert _compat.model_summary_options(summary) == (2, {"foo": 1})


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.lin(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit_loop_state_layout_is_lightnings(tmp_path) -> None:
    # The keys set_fit_loop_position rewrites are the ones the installed Lightning saves, and the
    # batch counter reads back the batches a real fit processed.
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Tiny(), DataLoader(torch.ones(10, 2), batch_size=2))
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=False)
    fit = ckpt["loops"]["fit_loop"]
    assert _compat.fit_loop_batches_processed(ckpt) == 3
    assert {"epoch_progress", "epoch_loop.batch_progress", "epoch_loop.state_dict"} <= set(fit)
    assert fit["epoch_loop.state_dict"]["_batches_that_stepped"] == 3
    assert set(fit["epoch_loop.batch_progress"]["current"]) == {"ready", "started", "processed", "completed"}
    _compat.set_fit_loop_position(ckpt, epoch=0, in_epoch=3, total=3, last_batch=False)
    assert fit["epoch_loop.state_dict"]["_batches_that_stepped"] == 2
    assert fit["epoch_progress"]["current"] == {"ready": 1, "started": 1, "processed": 0, "completed": 0}
