"""What a recipe run records: the logger chosen by ``logger=csv|tensorboard|wandb|mlflow`` (plus the CSV file,
unless ``logger.csv=false``), the learning rate, and the package's monitors named in ``callbacks.monitors``.

Nothing here reaches a network unless a service is configured: W&B runs offline (files in
``<output_dir>/wandb``) unless ``logger.offline=false`` or the environment names a W&B account
(``WANDB_API_KEY``, or ``WANDB_MODE=online``); MLflow writes a local file store (``<output_dir>/mlruns``) unless
``logger.tracking_uri`` or ``MLFLOW_TRACKING_URI`` names a server. A backend whose package is missing is an
error naming the extra to install (``pip install "lightning_4d[wandb]"``).

Example:
    >>> sorted(MONITORS)
    ['bubble', 'comm', 'experts', 'throughput']
    >>> monitor_callbacks(["throughput"])[0].__class__.__name__
    'FourDThroughputMonitor'
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from lightning_4d.recipes.schema import LOGGERS, MONITORS, LoggerConfig, check_monitors

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.loggers import Logger

__all__ = ["LOGGERS", "MONITORS", "build_logger_list", "check_logger", "check_monitors", "has_logger",
           "monitor_callbacks", "observe_callbacks", "plan_writer", "wandb_offline"]

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
    if name not in LOGGERS:
        raise ValueError(f"logger={name!r} is not one of {', '.join(LOGGERS)}; choose one on the command line, "
                         f"e.g. logger=tensorboard (CSV is written as well unless logger.csv=false).")
    modules, extra = LOGGERS[name]
    if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
        raise ValueError(f"logger={name} needs the {' or '.join(modules)} package, which is not installed: "
                         f"pip install \"lightning_4d[{extra}]\" (or pip install {modules[0]}), or choose "
                         f"logger=csv.")


def monitor_callbacks(names: Sequence[str]) -> list[L.Callback]:
    """The monitors named (:data:`MONITORS`), each built with its defaults, in the order given.

    Example:
        >>> [type(cb).__name__ for cb in monitor_callbacks(["comm", "experts"])]
        ['CommunicationMonitor', 'ExpertLoadMonitor']
    """
    check_monitors(names)
    callbacks = []
    for name in names:
        module, cls = MONITORS[name].split(":")
        callbacks.append(getattr(importlib.import_module(module), cls)())
    return callbacks


def observe_callbacks(monitors: Sequence[str], cfg: LoggerConfig) -> list[L.Callback]:
    """The monitors named and, when ``cfg`` gives a logger (:func:`has_logger`), Lightning's ``LearningRateMonitor``
    (the learning rate of every optimizer step, key ``lr``).

    Example:
        >>> from lightning_4d.recipes.schema import LoggerConfig
        >>> [type(cb).__name__ for cb in observe_callbacks(["comm"], LoggerConfig(csv=False))]
        ['CommunicationMonitor']
    """
    from lightning.pytorch.callbacks import LearningRateMonitor

    callbacks = monitor_callbacks(monitors)
    if has_logger(cfg):
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    return callbacks


def has_logger(cfg: LoggerConfig) -> bool:
    """Whether :func:`build_logger_list` returns a logger: every choice but ``logger=csv logger.csv=false``.

    Example:
        >>> from lightning_4d.recipes.schema import LoggerConfig
        >>> has_logger(LoggerConfig()), has_logger(LoggerConfig(csv=False)), has_logger(LoggerConfig("wandb", False))
        (True, False, True)
    """
    return cfg.csv or cfg.name != "csv"


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


def _tensorboard(cfg: LoggerConfig, root: Path) -> Logger:
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir=str(root), name="tensorboard")


def _wandb(cfg: LoggerConfig, root: Path) -> Logger:
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(name=cfg.run_name, save_dir=str(root), project=cfg.project, offline=wandb_offline(cfg.offline))


def _mlflow(cfg: LoggerConfig, root: Path) -> Logger:
    from lightning.pytorch.loggers import MLFlowLogger

    return MLFlowLogger(experiment_name=cfg.project, run_name=cfg.run_name, tracking_uri=_mlflow_uri(cfg, root))


_BUILDERS: dict[str, Callable[[LoggerConfig, Path], Logger]] = {
    "tensorboard": _tensorboard, "wandb": _wandb, "mlflow": _mlflow}


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
        loggers.append(_BUILDERS[cfg.name](cfg, root))
    assert bool(loggers) == has_logger(cfg)
    return loggers


def plan_writer(root: Path) -> L.Callback:
    """A callback writing the layout plan the strategy applied to ``<root>/layout_plan.json`` when a fit starts
    (global rank 0): the file ``parallel.plan=<it>`` gives back, edited or not.

    Example:
        >>> type(plan_writer(Path("/tmp/run"))).__name__
        'PlanWriter'
    """
    import lightning as L

    from lightning_4d.plan import PLAN_FILE

    class PlanWriter(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            plan = getattr(trainer.strategy, "layout_plan", None)
            if plan is not None and trainer.is_global_zero:
                root.mkdir(parents=True, exist_ok=True)
                plan.save(root / PLAN_FILE)

    return PlanWriter()
