"""conf/trainer/gpu.yaml's allocator setting reaches ``PYTORCH_CUDA_ALLOC_CONF`` before CUDA initialises: the recipe
sets it first thing (the environment's own setting wins), and refuses it, with a warning, once CUDA is up."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_4d.recipes import conf_dir, register_configs, to_train_config
from lightning_4d.recipes.build import ALLOC_CONF_ENV, apply_cuda_alloc_conf

register_configs()


def _gpu_config() -> Any:
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("train", ["trainer=gpu", "model=tiny_dense", "parallel=none", "trainer.devices=1"])


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    import os

    for name in ALLOC_CONF_ENV:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    for name in ALLOC_CONF_ENV:  # what the recipe set (monkeypatch then restores the environment's own)
        os.environ.pop(name, None)


def test_gpu_yaml_sets_expandable_segments_before_anything_runs(clean_env: pytest.MonkeyPatch) -> None:
    import os

    from lightning_4d.recipes import build, observe

    cfg = _gpu_config()
    assert to_train_config(cfg).trainer.cuda_alloc_conf == "expandable_segments:True"
    seen: list[Any] = []

    def first_step(name: str) -> None:  # what run() does right after validating: nothing is built yet
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise KeyboardInterrupt

    clean_env.setattr(observe, "check_logger", first_step)
    with pytest.raises(KeyboardInterrupt):
        build.run(cfg)
    assert seen == ["expandable_segments:True"]


def test_the_environment_wins_and_a_late_setting_is_refused(clean_env: pytest.MonkeyPatch) -> None:
    import os

    clean_env.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    apply_cuda_alloc_conf("expandable_segments:True")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    clean_env.delenv("PYTORCH_ALLOC_CONF")
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA was initialised before"):
        apply_cuda_alloc_conf("expandable_segments:True")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
