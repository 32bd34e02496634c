"""What a recipe run records: ``logger=tensorboard|wandb|mlflow`` write their runs in the run directory (W&B
offline, MLflow in a local file store: nothing reaches a network), ``callbacks.monitors=[...]`` log the
monitors' metrics, the learning rate logged every step follows ``optim.schedule``, and mistakes fail clearly."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from lightning_4d.recipes import conf_dir, register_configs, to_train_config
from lightning_4d.recipes.build import build_callbacks, build_loggers
from lightning_4d.recipes.schema import RecipeConfigError

CONF = str(conf_dir())
TINY = ["model=tiny_dense", "model.dim=32", "model.n_layers=2", "model.ffn_hidden=64", "model.max_seq_len=32",
        "trainer.log_every_n_steps=1", "trainer.val_check_interval=null", "trainer.limit_val_batches=0",
        "callbacks.progress_bar=false", "callbacks.checkpoint=false", "data=synthetic", "data.seq_len=16",
        "data.batch_size=4", "data.num_train_samples=64", "parallel=none", "trainer.devices=1"]


def _compose(overrides: list[str]) -> Any:
    register_configs()
    with initialize_config_dir(CONF, version_base=None):
        return compose("train", overrides)


NO_SERVICE = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI")


def _train(rank: int, overrides: list[str]) -> list[float]:
    import os

    from lightning_4d.recipes import run

    for key in NO_SERVICE:  # the ranks' environment is the forkserver's, not this test's: no W&B / MLflow service
        os.environ.pop(key, None)
    os.environ["WANDB_SILENT"] = "true"
    return run(_compose(overrides)).losses


def _run(overrides: list[str], ranks: int = 1) -> list[Any]:
    from lightning_4d.testing import run_world

    return run_world(_train, ranks, overrides, timeout_s=300, pg_timeout_s=60)


def _metrics(root: Path) -> list[dict[str, str]]:
    files = sorted((root / "csv").glob("version_*/metrics.csv"))
    assert files, f"no csv/version_*/metrics.csv under {root}"
    with files[-1].open() as f:
        return list(csv.DictReader(f))


def test_wandb_is_offline_unless_the_environment_configures_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_4d.recipes.observe import wandb_offline

    for key in NO_SERVICE:
        monkeypatch.delenv(key, raising=False)
    assert wandb_offline(None) is True
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_offline(None) is False and wandb_offline(True) is True
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_offline(None) is False


# ---------------------------------------------------------------------------------------------- loggers
def test_tensorboard_writes_event_files_in_the_run_dir(tmp_path: Path) -> None:
    if not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
        pytest.skip("needs tensorboard or tensorboardX (pip install 'lightning_4d[tensorboard]')")
    _run([*TINY, "trainer.max_steps=2", "logger=tensorboard", f"output_dir={tmp_path}"])
    assert list((tmp_path / "tensorboard").glob("version_0/events.out.tfevents.*"))
    assert any(r.get("train_loss") for r in _metrics(tmp_path))  # CSV beside it


def test_wandb_runs_offline_in_the_run_dir(tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="pip install 'lightning_4d[wandb]'")
    _run([*TINY, "trainer.max_steps=2", "logger=wandb", "logger.run_name=tiny", f"output_dir={tmp_path}"])
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir()) if (tmp_path / "wandb").exists() else tmp_path
    assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())  # the run's records, ready for `wandb sync`


def test_mlflow_uses_a_file_store_in_the_run_dir(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="pip install 'lightning_4d[mlflow]'")
    _run([*TINY, "trainer.max_steps=2", "logger=mlflow", f"output_dir={tmp_path}"])
    logged = {p.name for p in (tmp_path / "mlruns").glob("*/*/metrics/*")}
    assert {"train_loss", "lr"} <= logged, logged


def test_a_missing_backend_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    from lightning_4d.recipes import run

    cfg = _compose([*TINY, "logger=wandb", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"logger=wandb needs the wandb package.*pip install \"lightning_4d\[wandb\]"):
        build_loggers(to_train_config(cfg), tmp_path)
    with pytest.raises(ValueError, match=r"logger=wandb needs the wandb package"):
        run(cfg)  # before anything is built: no run directory content
    assert not (tmp_path / "csv").exists()


def test_logger_mistakes_fail_clearly() -> None:
    with pytest.raises(RecipeConfigError, match=r"logger='neptune' is not one of csv, tensorboard, wandb, mlflow"):
        to_train_config(_compose([*TINY, "logger.name=neptune"]))
    with pytest.raises(ConfigCompositionException, match=r"neptune"):
        _compose([*TINY, "logger=neptune"])  # Hydra lists the options of the group


def test_csv_off_means_no_logger_and_no_lr_monitor(tmp_path: Path) -> None:
    cfg = to_train_config(_compose([*TINY, "logger.csv=false"]))
    assert build_loggers(cfg, tmp_path) == []
    assert "LearningRateMonitor" not in [type(cb).__name__ for cb in build_callbacks(cfg, tmp_path)]


# ---------------------------------------------------------------------------------------------- monitors
def test_unknown_monitor_lists_the_valid_ones() -> None:
    with pytest.raises(RecipeConfigError, match=r"'bubbles' is not a monitor \(did you mean 'bubble'\?\); the "
                                                r"monitors are bubble, comm, experts, throughput"):
        to_train_config(_compose([*TINY, "callbacks.monitors=[bubbles]"]))


def test_monitors_log_their_metrics(tmp_path: Path) -> None:
    """tiny MoE, pp=2 on 2 ranks: every monitor has something to measure and logs it to metrics.csv."""
    moe = ["model=tiny_moe", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.num_experts=4",
           "model.max_seq_len=32", "parallel.pp=2", "parallel.microbatches=2", "trainer.devices=2"]
    _run([*TINY, *moe, "trainer.max_steps=3", "callbacks.monitors=[bubble,comm,experts,throughput]",
          f"output_dir={tmp_path}"], ranks=2)
    keys = set().union(*(row.keys() for row in _metrics(tmp_path)))
    for prefix in ("pp/bubble_fraction", "comm/", "moe/", "perf/tokens_per_second"):
        assert any(k.startswith(prefix) for k in keys), (prefix, sorted(keys))


# ---------------------------------------------------------------------------------------------- schedule
def test_logged_lr_follows_the_schedule(tmp_path: Path) -> None:
    """warm-up 2, cosine to 0.1 · lr at trainer.max_steps=8 (the default horizon): the lr logged at step s is
    lr · factor(s), the formula written out here."""
    lr, warmup, steps, floor = 0.01, 2, 8, 0.1
    _run([*TINY, f"trainer.max_steps={steps}", f"optim.lr={lr}", f"optim.warmup_steps={warmup}",
          "optim.schedule=cosine", f"optim.min_lr_ratio={floor}", f"output_dir={tmp_path}"])
    logged = {int(r["step"]): float(r["lr"]) for r in _metrics(tmp_path) if r.get("lr")}
    assert sorted(logged) == list(range(steps)), logged

    def expected(s: int) -> float:
        if s < warmup:
            return lr * (s + 1) / warmup
        return lr * (floor + (1 - floor) * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))) / 2)

    assert [logged[s] for s in range(steps)] == pytest.approx([expected(s) for s in range(steps)], rel=1e-6)


def test_model_hf_gets_the_fine_tuning_defaults() -> None:
    """The numbers quoted in conf/optim/*.yaml and conf/model_optim/hf.yaml."""
    hf = [f"model.config={Path(__file__).parent / 'data' / 'tiny_llama_config.json'}"]
    o = to_train_config(_compose(["model=hf", *hf])).optim
    assert (o.name, o.lr, o.warmup_steps, o.schedule, o.min_lr_ratio, o.decay_steps) == (
        "finetune", 2e-5, 10, "linear", 0.0, None)
    o = to_train_config(_compose(["model=hf", *hf, "model_optim=none"])).optim
    assert (o.name, o.lr, o.schedule, o.min_lr_ratio, o.warmup_steps) == ("adamw", 3e-3, "cosine", 0.1, 20)
    assert to_train_config(_compose(["model=hf", *hf, "optim.lr=1e-4"])).optim.lr == 1e-4
    assert to_train_config(_compose(["model=tiny_dense"])).optim.name == "adamw"
