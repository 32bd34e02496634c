"""What a recipe run records: the logger chosen by ``logger=csv|tensorboard|wandb|mlflow`` (plus the CSV file,
unless ``logger.csv=false``), the learning rate, and the package's monitors named in ``callbacks.monitors``.

The loggers are built from their registry, :mod:`lightning_4d.recipes.loggers` (re-exported here); a backend whose
package is missing is an error naming the extra to install (``pip install "lightning_4d[wandb]"``).

Example:
    >>> sorted(MONITORS)
    ['bubble', 'comm', 'experts', 'throughput']
    >>> monitor_callbacks(["throughput"])[0].__class__.__name__
    'FourDThroughputMonitor'
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from lightning_4d.recipes.loggers import (
    LOGGERS, LoggerConfig, build_logger_list, check_logger, has_logger, wandb_offline,
)
from lightning_4d.recipes.sections import MONITORS, check_monitors

if TYPE_CHECKING:
    import lightning as L

__all__ = ["LOGGERS", "MONITORS", "build_logger_list", "check_logger", "check_monitors", "has_logger",
           "monitor_callbacks", "observe_callbacks", "plan_writer", "wandb_offline"]


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
