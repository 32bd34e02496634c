"""The planner's pipeline numbers: the bubble and in-flight micro-batches, imported from the schedule's record.

The bubble of a schedule has one definition, :func:`lightning_4d.pipeline.schedules.bubble_theory` (a
closed form under unit costs: ``F = I = W = 1``, ``B = 2`` per stage chunk), which
``tests/unit/test_planner.py`` checks against the replay of torch's own action table
(:func:`lightning_4d.pipeline.bubble.bubble_from_actions`) for every ``(p, v, m)`` torch accepts. The
planner imports it; :func:`replayed_bubble` runs the replay itself (cached) for the search's ``replay=True``.
The in-flight micro-batches (activations a rank holds at its peak) are the record's too:
:func:`lightning_4d.pipeline.schedules.in_flight_microbatches`.

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

from lightning_4d.pipeline.schedules import bubble_theory, in_flight_microbatches

__all__ = ["bubble_theory", "in_flight_microbatches", "replayed_bubble"]


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

