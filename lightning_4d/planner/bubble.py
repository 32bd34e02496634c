"""The planner's pipeline numbers: the bubble (imported, not recomputed) and in-flight micro-batches.

The bubble of a schedule has one definition, :func:`lightning_4d.pipeline.schedules.bubble_theory` (a
closed form under unit costs: ``F = I = W = 1``, ``B = 2`` per stage chunk), which
``tests/unit/test_planner.py`` checks against the replay of torch's own action table
(:func:`lightning_4d.pipeline.bubble.bubble_from_actions`) for every ``(p, v, m)`` torch accepts. The
planner imports it; :func:`replayed_bubble` runs the replay itself (cached) for the search's ``replay=True``.

In-flight micro-batches (activations a rank holds at its peak, in units of *one micro-batch through
all of that rank's layers*), rank ``i`` of ``p``:

- GPipe: ``m`` (all forwards before any backward);
- 1F1B: ``min(p − i, m)``;
- interleaved 1F1B (Megatron's warm-up of ``(v − 1)·p + 2·(p − i − 1)`` chunk micro-batches, plus
  the one in flight): ``min(((v − 1)·p + 2·(p − i − 1) + 1) / v, m)``;
- ZBV: ``min(p, m)`` on every rank (same peak as 1F1B's first rank, balanced by the V placement);
- DualPipeV: ``min(p + 1, m)`` (DeepSeek-V3 report: ``PP + 1`` micro-batches of activations).

Example:
    >>> bubble_theory("1f1b", p=4, m=8)
    0.2727272727272727
    >>> round(replayed_bubble("zbv", 8, 1, v=2), 3)  # torch's ZBV table with one micro-batch
    0.824
    >>> in_flight_microbatches("1f1b", p=4, m=8, rank=0), in_flight_microbatches("gpipe", 4, 8, 0)
    (4, 8)
"""

from __future__ import annotations

from functools import lru_cache
from typing import Union

from lightning_4d.config import SCHEDULES
from lightning_4d.pipeline.schedules import bubble_theory, get_schedule_info

__all__ = ["in_flight_microbatches", "replayed_bubble"]


@lru_cache(maxsize=4096)
def replayed_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Bubble share of torch's own action table for the schedule, replayed under unit costs
    (:func:`lightning_4d.pipeline.bubble.bubble_from_actions`); 0 without pipelining. Cached.

    Example:
        >>> replayed_bubble("1f1b", 4, 8) == 3 / 11
        True
    """
    if p == 1:
        return 0.0
    from lightning_4d.pipeline.bubble import bubble_from_actions

    return float(bubble_from_actions(schedule, p, v, m))


def in_flight_microbatches(schedule: str, p: int, m: int, rank: int, v: int = 1) -> Union[int, float]:
    """Peak number of micro-batches whose activations rank ``rank`` holds (see the module docstring),
    in units of one micro-batch through all of the rank's layers.

    Example:
        >>> [in_flight_microbatches("1f1b", 4, 8, r) for r in range(4)]
        [4, 3, 2, 1]
        >>> in_flight_microbatches("interleaved_1f1b", 4, 8, 0, v=2)
        5.5
    """
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    key = get_schedule_info(schedule).name
    if key not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: the planner has no in-flight micro-batch count for it; use one "
                         f"of {SCHEDULES}.")
    if p > 1:
        get_schedule_info(key).check_virtual_stages(v)
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank} must be in [0, {p}).")
    if p == 1:
        return 1 if key != "gpipe" else m
    if key == "gpipe":
        return m
    if key == "1f1b":
        return min(p - rank, m)
    if key == "interleaved_1f1b":
        return min(((v - 1) * p + 2 * (p - rank - 1) + 1) / v, m)
    if key == "zbv":
        return min(p, m)
    return min(p + 1, m)
