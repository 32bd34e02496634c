"""The ``logger`` group: its schema (:class:`LoggerConfig`) and the one registry of its choices (:data:`LOGGERS`: one
:class:`LoggerKind` per name — the packages that provide it, the extra that installs them and how it is built).

A new logger is one more :class:`LoggerKind` here (and a ``conf/logger/<name>.yaml`` naming it): the schema's
check, :func:`check_logger` and :func:`build_logger_list` all read this registry, so a name cannot be known to one
and missing from another. Nothing reaches a network unless a service is configured: W&B runs offline (files in
``<output_dir>/wandb``) unless ``logger.offline=false`` or the environment names a W&B account
(``WANDB_API_KEY``, or ``WANDB_MODE=online``); MLflow writes a local file store (``<output_dir>/mlruns``) unless
``logger.tracking_uri`` or ``MLFLOW_TRACKING_URI`` names a server.

Example:
    >>> list(LOGGERS), LOGGERS["wandb"].extra
    (['csv', 'tensorboard', 'wandb', 'mlflow'], 'wandb')
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from lightning_4d.recipes.errors import RecipeConfigError

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger

__all__ = ["LOGGERS", "LoggerConfig", "LoggerKind", "build_logger_list", "check_logger", "has_logger",
           "wandb_offline"]


@dataclass
class LoggerConfig:
    """The ``logger`` group (``conf/logger/``): ``name`` = ``csv``, ``tensorboard``, ``wandb`` or ``mlflow``, plus a
    CSV file (``csv``; the only logger of ``logger=csv``; ``logger.csv=false`` there: no logger at all).
    ``project`` / ``run_name``: the W&B project or MLflow experiment, and the run's name. ``offline`` (W&B;
    ``null``: offline unless ``WANDB_API_KEY`` is set or ``WANDB_MODE=online``) and ``tracking_uri`` (MLflow;
    ``null``: ``MLFLOW_TRACKING_URI``, else a file store in ``<output_dir>/mlruns``). Built by
    :func:`build_logger_list` from its :class:`LoggerKind` in :data:`LOGGERS`.

    Example:
        >>> LoggerConfig().name
        'csv'
        >>> LoggerConfig(name="neptune")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.errors.RecipeConfigError: logger='neptune' is not one of csv, tensorboard, ...
    """

    name: str = "csv"
    csv: bool = True
    project: str = "lightning_4d"
    run_name: Optional[str] = None
    offline: Optional[bool] = None
    tracking_uri: Optional[str] = None

    def __post_init__(self) -> None:
        try:
            logger_kind(self.name)
        except ValueError as err:
            raise RecipeConfigError(str(err)) from None


@dataclass(frozen=True)
class LoggerKind:
    """One ``logger`` choice: its name, the packages any one of which provides it, the ``pyproject.toml`` extra
    that installs them, and ``build(cfg, root)``, the Lightning logger writing under the run directory (``None``
    for ``csv``: the CSV file alone, which :func:`build_logger_list` adds beside every choice).

    Example:
        >>> LOGGERS["tensorboard"].modules
        ('tensorboard', 'tensorboardX')
    """

    name: str
    modules: tuple[str, ...] = ()
    extra: str = ""
    build: Optional[Callable[[LoggerConfig, Path], "Logger"]] = field(default=None, repr=False)


def wandb_offline(offline: bool | None) -> bool:
    """Whether W&B runs offline: ``offline`` when set, else unless the environment configures a W&B service
    (``WANDB_API_KEY`` set, or ``WANDB_MODE=online``).

    Example:
        >>> wandb_offline(True), wandb_offline(False)
        (True, False)
    """
    if offline is not None:
        return offline
    return not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() == "online")


def _mlflow_uri(cfg: LoggerConfig, root: Path) -> str:
    """``logger.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a file store in ``<root>/mlruns``: no server
    and no database package needed (recent MLflow versions refuse a file store unless ``MLFLOW_ALLOW_FILE_STORE=true``,
    set here for that case only)."""
    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (root / "mlruns").absolute().as_uri()


def _tensorboard(cfg: LoggerConfig, root: Path) -> "Logger":
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir=str(root), name="tensorboard")


def _wandb(cfg: LoggerConfig, root: Path) -> "Logger":
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(name=cfg.run_name, save_dir=str(root), project=cfg.project, offline=wandb_offline(cfg.offline))


def _mlflow(cfg: LoggerConfig, root: Path) -> "Logger":
    from lightning.pytorch.loggers import MLFlowLogger

    return MLFlowLogger(experiment_name=cfg.project, run_name=cfg.run_name, tracking_uri=_mlflow_uri(cfg, root))


LOGGERS: dict[str, LoggerKind] = {kind.name: kind for kind in (
    LoggerKind("csv"),
    LoggerKind("tensorboard", ("tensorboard", "tensorboardX"), "tensorboard", _tensorboard),
    LoggerKind("wandb", ("wandb",), "wandb", _wandb),
    LoggerKind("mlflow", ("mlflow",), "mlflow", _mlflow),
)}
"""The ``logger`` choices, by name: the one registry the schema, the check and the builder read."""


def logger_kind(name: str) -> LoggerKind:
    """The registry's record of ``name``; an unknown name is refused here, naming the choices.

    Example:
        >>> logger_kind("neptune")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: logger='neptune' is not one of csv, tensorboard, wandb, mlflow; ...
    """
    if name not in LOGGERS:
        raise ValueError(f"logger={name!r} is not one of {', '.join(LOGGERS)}; choose one on the command line, "
                         f"e.g. logger=tensorboard (CSV is written as well unless logger.csv=false).")
    return LOGGERS[name]


def check_logger(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a logger choice whose package is installed; the message names the
    choices, or the extra to install.

    Example:
        >>> check_logger("csv")
        >>> check_logger("neptune")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: logger='neptune' is not one of csv, tensorboard, wandb, mlflow; ...
    """
    kind = logger_kind(name)
    modules, extra = kind.modules, kind.extra
    if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
        raise ValueError(f"logger={name} needs the {' or '.join(modules)} package, which is not installed: "
                         f"pip install \"lightning_4d[{extra}]\" (or pip install {modules[0]}), or choose "
                         f"logger=csv.")


def has_logger(cfg: LoggerConfig) -> bool:
    """Whether :func:`build_logger_list` returns a logger: every choice but ``logger=csv logger.csv=false``.

    Example:
        >>> from lightning_4d.recipes.schema import LoggerConfig
        >>> has_logger(LoggerConfig()), has_logger(LoggerConfig(csv=False)), has_logger(LoggerConfig("wandb", False))
        (True, False, True)
    """
    return cfg.csv or cfg.name != "csv"


def build_logger_list(cfg: LoggerConfig, root: Path) -> list[Logger]:
    """``CSVLogger`` (``<root>/csv``; for ``logger=csv``, and beside the others unless ``logger.csv=false``), then
    the chosen backend writing under ``root``: ``tensorboard/``, ``wandb/``, ``mlruns/`` (MLflow's file store).

    Example:
        >>> from lightning_4d.recipes.schema import LoggerConfig
        >>> [type(lg).__name__ for lg in build_logger_list(LoggerConfig(), Path("/tmp/x"))]
        ['CSVLogger']
    """
    from lightning.pytorch.loggers import CSVLogger

    check_logger(cfg.name)
    loggers: list[Logger] = []
    if cfg.csv:
        loggers.append(CSVLogger(save_dir=str(root), name="csv"))
    if cfg.name != "csv":
        build = logger_kind(cfg.name).build
        assert build is not None  # csv alone builds nothing but the CSV file
        loggers.append(build(cfg, root))
    assert bool(loggers) == has_logger(cfg)
    return loggers
