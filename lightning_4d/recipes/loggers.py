"""The ``logger`` group's schema and choices (:class:`LoggerConfig`, :data:`LOGGERS`); built by
:mod:`lightning_4d.recipes.observe`.

Example:
    >>> sorted(LOGGERS)
    ['csv', 'mlflow', 'tensorboard', 'wandb']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_4d.recipes.errors import RecipeConfigError

__all__ = ["LOGGERS", "LoggerConfig"]


# name -> (the packages any one of which provides it, the pyproject extra that installs it); csv needs none.
LOGGERS: dict[str, tuple[tuple[str, ...], str]] = {
    "csv": ((), ""),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
}
"""The ``logger`` choices (built by :mod:`lightning_4d.recipes.observe`): the modules that provide each and the extra of ``pyproject.toml`` that installs them."""


@dataclass
class LoggerConfig:
    """The ``logger`` group (``conf/logger/``): ``name`` = ``csv``, ``tensorboard``, ``wandb`` or ``mlflow``, plus a
    CSV file (``csv``; the only logger of ``logger=csv``; ``logger.csv=false`` there: no logger at all).
    ``project`` / ``run_name``: the W&B project or MLflow experiment, and the run's name. ``offline`` (W&B;
    ``null``: offline unless ``WANDB_API_KEY`` is set or ``WANDB_MODE=online``) and ``tracking_uri`` (MLflow;
    ``null``: ``MLFLOW_TRACKING_URI``, else a file store in ``<output_dir>/mlruns``). Built by
    :func:`lightning_4d.recipes.observe.build_logger_list`.

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
        if self.name not in LOGGERS:
            raise RecipeConfigError(f"logger={self.name!r} is not one of {', '.join(LOGGERS)}; e.g. "
                                    f"logger=tensorboard (CSV is written as well unless logger.csv=false).")
