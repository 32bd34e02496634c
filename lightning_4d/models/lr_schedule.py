"""Learning-rate schedules of :class:`~lightning_4d.models.CausalLM`: linear warm-up, then constant, cosine or
linear decay to a floor (``min_lr_ratio`` × the peak learning rate) at ``decay_steps``.

The factor multiplying the peak learning rate at optimizer step ``s`` (0-based; ``W`` warm-up steps, ``D``
the decay horizon, ``r`` the floor ratio, ``p = (s - W) / (D - W)`` clipped to ``[0, 1]``):

- ``s < W``: ``(s + 1) / W`` (the first step already trains, at ``1 / W`` of the peak),
- ``constant``: ``1``,
- ``cosine``: ``r + (1 - r) · (1 + cos(π p)) / 2``,
- ``linear``: ``r + (1 - r) · (1 - p)``,

so the decay reaches ``r`` at step ``D`` and stays there. :class:`WarmupDecay` is that factor as a picklable
callable for ``torch.optim.lr_scheduler.LambdaLR`` (its state is saved with the checkpoint).

Example:
    >>> f = WarmupDecay("cosine", warmup_steps=10, decay_steps=110, min_lr_ratio=0.1)
    >>> [round(f(s), 4) for s in (0, 9, 10, 60, 110, 500)]
    [0.1, 1.0, 1.0, 0.55, 0.1, 0.1]
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "WarmupDecay", "check_schedule", "lr_factor"]

SCHEDULES = ("constant", "cosine", "linear")
"""The schedule names (``optim.schedule`` of the recipes, ``CausalLM(schedule=...)``)."""


def check_schedule(schedule: str, warmup_steps: int, decay_steps: int | None, min_lr_ratio: float,
                   prefix: str = "") -> None:
    """Raise ``ValueError`` naming the argument (``prefix`` + name) when the schedule's arguments break a rule.

    Example:
        >>> check_schedule("cosine", 10, 5, 0.1, prefix="optim.")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: optim.decay_steps=5 must exceed optim.warmup_steps=10 ...
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"{prefix}schedule={schedule!r} is not one of {', '.join(SCHEDULES)}; e.g. "
                         f"{prefix}schedule=cosine (warm-up, then cosine decay to {prefix}min_lr_ratio).")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"{prefix}warmup_steps={warmup_steps!r} must be an integer >= 0 (0: no warm-up).")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"{prefix}min_lr_ratio={min_lr_ratio} must be in [0, 1]: the floor of the decay as a share "
                         f"of the peak learning rate (e.g. 0.1).")
    if decay_steps is not None and schedule != "constant" and decay_steps <= warmup_steps:
        raise ValueError(f"{prefix}decay_steps={decay_steps} must exceed {prefix}warmup_steps={warmup_steps} "
                         f"(the decay runs from the end of the warm-up to decay_steps); raise it, lower the "
                         f"warm-up, or use {prefix}schedule=constant.")


def lr_factor(step: int, schedule: str, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """The factor multiplying the peak learning rate at optimizer step ``step`` (0-based); see the module.

    Example:
        >>> lr_factor(5, "linear", warmup_steps=0, decay_steps=10, min_lr_ratio=0.0)
        0.5
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps)))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class WarmupDecay:
    """:func:`lr_factor` with fixed arguments: the ``lr_lambda`` of ``torch.optim.lr_scheduler.LambdaLR``
    (a class, not a closure, so the scheduler's state dict keeps it).

    Example:
        >>> WarmupDecay("linear", warmup_steps=0, decay_steps=4, min_lr_ratio=0.0)(2)
        0.5
    """

    def __init__(self, schedule: str, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> None:
        check_schedule(schedule, warmup_steps, decay_steps, min_lr_ratio)
        self.schedule, self.warmup_steps = schedule, warmup_steps
        self.decay_steps, self.min_lr_ratio = decay_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.schedule, self.warmup_steps, self.decay_steps, self.min_lr_ratio)

    def __repr__(self) -> str:
        return (f"WarmupDecay({self.schedule!r}, warmup_steps={self.warmup_steps}, decay_steps={self.decay_steps}, "
                f"min_lr_ratio={self.min_lr_ratio})")
