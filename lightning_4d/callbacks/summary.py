"""Lightning's model summary with the whole model's parameter counts.

Under pipeline parallelism a rank holds one stage, so Lightning's own summary (computed on rank 0)
reports that stage's parameters as the model's. :class:`FourDModelSummary` keeps Lightning's table
(this rank's modules, DTensor parameters at their global size) and replaces the totals and the
model size by the whole model's, counted by :class:`~lightning_4d.strategy.FourDStrategy` before it
split the model (tied weights once). ``FourDStrategy`` swaps it in for Lightning's default summary.

Example:
    >>> FourDModelSummary(max_depth=1).rich
    False
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from typing_extensions import override

from lightning_4d import _compat

__all__ = ["FourDModelSummary", "use_whole_model_summary"]


class FourDModelSummary(ModelSummary):
    """:class:`~lightning.pytorch.callbacks.ModelSummary` whose totals are the whole model's.

    Args:
        max_depth: as Lightning's (0 turns the summary off).
        rich: print with :class:`~lightning.pytorch.callbacks.RichModelSummary`'s table.
        **summarize_kwargs: passed to the table printer.

    Example:
        >>> # not run: needs a Trainer
        >>> trainer = L.Trainer(strategy=FourDStrategy(pp=2), callbacks=[FourDModelSummary()])  # doctest: +SKIP
    """

    def __init__(self, max_depth: int = 1, rich: bool = False, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth=max_depth, **summarize_kwargs)
        self.max_depth = max_depth
        self.rich = rich
        self.summarize_kwargs = summarize_kwargs

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        counts = getattr(trainer.strategy, "parameter_counts", None)
        if not self.max_depth or counts is None:
            return super().on_fit_start(trainer, pl_module)
        data, size, modes, flops, local_total = _compat.model_summary_parts(self, trainer, pl_module)
        data = _whole_model_rows(data, getattr(trainer.strategy, "module_parameter_counts", {}))
        if trainer.is_global_zero:
            total, trainable = counts
            printer = RichModelSummary.summarize if self.rich else ModelSummary.summarize
            scaled = size * total / local_total if local_total else 0.0  # the summary's bytes per parameter
            printer(data, total, trainable, scaled, modes, total_flops=flops, **self.summarize_kwargs)


def _whole_model_rows(data: list[tuple[str, list[str]]], counts: dict[str, int]) -> list[tuple[str, list[str]]]:
    """Lightning's table columns with the "Params" of every listed module replaced by its whole-model count."""
    columns = dict(data)
    names, params = columns.get("Name"), columns.get("Params")
    if names is None or params is None:
        return data
    fixed = [get_human_readable_count(counts[n]) if n in counts else p for n, p in zip(names, params)]
    return [(title, fixed if title == "Params" else values) for title, values in data]


def use_whole_model_summary(trainer: "pl.Trainer") -> None:
    """Replace Lightning's own (Rich)ModelSummary in ``trainer.callbacks`` by a :class:`FourDModelSummary`
    with the same depth; a user's subclass is left alone.

    Example:
        >>> # not run: needs a Trainer
        >>> use_whole_model_summary(trainer)  # doctest: +SKIP
    """
    for i, cb in enumerate(trainer.callbacks):
        if type(cb) in (ModelSummary, RichModelSummary):
            depth, kwargs = _compat.model_summary_options(cb)
            trainer.callbacks[i] = FourDModelSummary(depth, rich=isinstance(cb, RichModelSummary), **kwargs)


def _register() -> None:
    from lightning_4d.strategy import FIT_SETUP_HOOKS

    if use_whole_model_summary not in FIT_SETUP_HOOKS:
        FIT_SETUP_HOOKS.append(use_whole_model_summary)  # Lightning's summary would count this rank's stage only


_register()
