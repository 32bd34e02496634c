"""Hydra recipes for lightning_4d: structured configs over the package's own dataclasses, builders
(``hydra.utils.instantiate`` of each group's ``_target_``) and the fail-fast resource check.

The YAML config groups live in ``conf/`` at the repository root and the entry point is
``recipes/train.py``; this package holds the importable, testable logic behind them.

Example:
    >>> from hydra import compose, initialize_config_dir
    >>> from lightning_4d.recipes import conf_dir, register_configs, to_train_config
    >>> register_configs()
    >>> with initialize_config_dir(str(conf_dir()), version_base=None):
    ...     cfg = compose("train", ["parallel=tp"])
    >>> to_train_config(cfg).parallel.tp
    2
"""

from pathlib import Path

from lightning_4d.recipes.build import (
    build_callbacks,
    build_data,
    build_loggers,
    build_model,
    build_network,
    build_strategy,
    build_trainer,
    output_dir,
    validate,
)
from lightning_4d.recipes.launch import RunResult, run
from lightning_4d.recipes.resources import ResourceError, check_resources, count_params
from lightning_4d.recipes.schema import RecipeConfigError, TrainConfig, register_configs, to_train_config

__all__ = [
    "RecipeConfigError",
    "ResourceError",
    "RunResult",
    "TrainConfig",
    "build_callbacks",
    "build_data",
    "build_loggers",
    "build_model",
    "build_network",
    "build_strategy",
    "build_trainer",
    "check_resources",
    "conf_dir",
    "count_params",
    "output_dir",
    "register_configs",
    "run",
    "to_train_config",
    "validate",
]


def conf_dir() -> Path:
    """The ``conf/`` directory of the repository (the recipes' Hydra config root).

    Example:
        >>> (conf_dir() / "train.yaml").exists()
        True
    """
    return Path(__file__).resolve().parents[2] / "conf"
