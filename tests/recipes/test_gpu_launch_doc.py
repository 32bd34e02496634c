"""The per-GPU GiB figures ``recipes/README.md`` quotes after its GPU launch commands are the planner's model states
per rank for those commands' overrides (they have never run on a GPU, and the page says so)."""

from __future__ import annotations

import re
from pathlib import Path

from hydra import compose, initialize_config_dir

from lightning_4d.recipes import conf_dir, register_configs, to_train_config
from lightning_4d.recipes.resources import GiB, model_spec, states_bytes_per_rank
from lightning_4d.recipes.schema import owned

PAGE = (Path(__file__).resolve().parents[2] / "recipes" / "README.md").read_text()


def _states_gib(overrides: list[str], world: int) -> float:
    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base=None):
        c = to_train_config(compose("train", overrides))
    return states_bytes_per_rank(model_spec(c.model), owned("parallel", c.parallel).resolve(world)) / GiB


def test_launch_figures_are_the_planners_states() -> None:
    assert "These commands have not been run: no GPU has executed lightning_4d yet" in PAGE
    quoted = [int(x) for x in re.findall(r"~(\d+) GiB per GPU of\s+weights, gradients and AdamW states", PAGE)]
    llama = _states_gib(["trainer=gpu", "model=llama3_8b", "parallel=tp", "parallel.tp=4"], 8)
    mixtral = _states_gib(["trainer=gpu", "model=mixtral_8x7b", "parallel.tp=8", "parallel.pp=4", "parallel.ep=8",
                           "parallel.dp=1", "parallel.microbatches=8"], 32)
    moe_1t = _states_gib(["trainer=gpu", "model=moe_1t", "parallel=moe_1t"], 512)
    assert quoted == [round(llama), round(mixtral), round(moe_1t)], (quoted, llama, mixtral, moe_1t)


def test_gpu_trainer_config(tmp_path: Path) -> None:
    """``trainer=gpu`` takes every GPU of the node and says its matmul precision; the recipes apply
    ``trainer.float32_matmul_precision`` before building the Trainer and refuse an unknown one."""
    import pytest
    import torch

    from lightning_4d.recipes.build import build_trainer
    from lightning_4d.recipes.schema import RecipeConfigError

    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base=None):
        gpu = to_train_config(compose("train", ["trainer=gpu"]))
        cpu = compose("train", ["parallel=none", "trainer.devices=1", "trainer.float32_matmul_precision=high"])
        bad = compose("train", ["trainer.float32_matmul_precision=tf32"])
    assert (gpu.trainer.devices, gpu.trainer.precision, gpu.trainer.float32_matmul_precision) == (
        "auto", "bf16-mixed", "highest")
    with pytest.raises(RecipeConfigError, match="float32_matmul_precision"):
        to_train_config(bad)
    try:
        build_trainer(to_train_config(cpu), tmp_path)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")
