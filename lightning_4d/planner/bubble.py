"""Pipeline bubble and in-flight micro-batches per schedule — one owner for the bubble.

The bubble of a schedule the runtime runs (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zbv``,
``dualpipev``) is the replay of torch's own action table under unit costs
(:func:`lightning_4d.pipeline.bubble.bubble_from_actions`, ``F = I = W = 1``, ``B = 2`` per stage
chunk). Its closed form lives in :func:`lightning_4d.pipeline.schedules.bubble_theory` and equals
the replay for every ``(p, v, m)`` torch accepts (``tests/unit/test_planner.py`` checks a grid);
:func:`bubble_fraction` gives the same numbers, :func:`replayed_bubble` runs the replay (cached).

Costs per micro-batch through all of a rank's layers: forward ``F``, input-gradient backward ``B``
and weight-gradient backward ``W``; with ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank
each rank works ``m·(F + B + W)`` and idles ``I``; the share is ``I / (m·T + I)``, ``T = F + B + W``:

===================  ==============================================  ==========================
schedule             idle time ``I``                                 share, unit costs, m ≥ 2p
===================  ==============================================  ==========================
GPipe, 1F1B          ``(p − 1)·T``                                   ``(p − 1)/(m + p − 1)``
interleaved 1F1B     ``(v·max(m,p) + min(m,p) − 1 − v·m)·T / v``     ``(p − 1)/(v·m + p − 1)``
ZB-H1 (theory only)  ``(p − 1)·(F + B − W)``                         ``(p − 1)/(3m + p − 1)``
ZBV                  ``max(p − 1, 4p − 2m − 2)·T / (3v)``            ``(p − 1)/(6m + p − 1)``
DualPipeV            ``(p − 1)·T / (3v)``                            ``(p − 1)/(6m + p − 1)``
===================  ==============================================  ==========================

(Narayanan et al. 2021 for GPipe / 1F1B / interleaving; Qi et al. 2024 for the zero-bubble ones:
deferring ``W`` fills the warm-up and cool-down, leaving the ``p − 1`` start-up chunk forwards;
torch's ZBV table with few micro-batches cannot fill its warm-up: 82% idle at ``p = 8, m = 1``.)
The V-schedule rows are exact for ``F = B = W`` (the replay's costs); ZB-H1 is not one of torch's
schedules and keeps its textbook form.

In-flight micro-batches (activations a rank holds at its peak, in units of *one micro-batch through
all of that rank's layers*), rank ``i`` of ``p``:

- GPipe: ``m`` (all forwards before any backward);
- 1F1B and ZB-H1: ``min(p − i, m)``;
- interleaved 1F1B (Megatron's warm-up of ``(v − 1)·p + 2·(p − i − 1)`` chunk micro-batches, plus
  the one in flight): ``min(((v − 1)·p + 2·(p − i − 1) + 1) / v, m)``;
- ZBV: ``min(p, m)`` on every rank (same peak as 1F1B's first rank, balanced by the V placement);
- DualPipeV: ``min(p + 1, m)`` (DeepSeek-V3 report: ``PP + 1`` micro-batches of activations).

Example:
    >>> bubble_fraction("1f1b", p=4, m=8)
    0.2727272727272727
    >>> idle_time("zb_h1", 4, 8) / idle_time("1f1b", 4, 8)
    0.3333333333333333
    >>> round(bubble_fraction("zbv", 8, 1, v=2), 3)  # torch's ZBV table with one micro-batch
    0.824
    >>> in_flight_microbatches("1f1b", p=4, m=8, rank=0), in_flight_microbatches("gpipe", 4, 8, 0)
    (4, 8)
"""

from __future__ import annotations

from functools import lru_cache
from typing import Union

__all__ = ["THEORY_SCHEDULES", "bubble_fraction", "idle_time", "in_flight_microbatches", "replayed_bubble",
           "stages_per_rank"]

THEORY_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
_V_SCHEDULES = ("zbv", "dualpipev")


def _check(schedule: str, p: int, m: int, v: int) -> str:
    key = schedule.lower().replace("-", "_")
    key = {"interleaved": "interleaved_1f1b", "zbh1": "zb_h1", "zb_v": "zbv"}.get(key, key)
    if key not in THEORY_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} has no closed form here; use one of {THEORY_SCHEDULES}.")
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if key in _V_SCHEDULES and p > 1 and v != 2:
        raise ValueError(f"schedule {key!r} places exactly 2 stages per rank (V shape); got v={v}.")
    if key in ("gpipe", "1f1b", "zb_h1") and v != 1:
        raise ValueError(f"schedule {key!r} runs one stage per rank; got v={v}. Use 'interleaved_1f1b'.")
    return key


def stages_per_rank(schedule: str, pp: int) -> int:
    """Default stages per rank ``v`` of a schedule (1, or 2 for interleaved / V schedules when ``pp > 1``).

    Example:
        >>> stages_per_rank("zbv", 4), stages_per_rank("1f1b", 4), stages_per_rank("zbv", 1)
        (2, 1, 1)
    """
    if pp == 1:
        return 1
    return 2 if schedule in ("interleaved_1f1b",) + _V_SCHEDULES else 1


def idle_time(schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """Idle time ``I`` of each rank per step in units of the per-rank costs (table in the module docstring).

    Example:
        >>> idle_time("1f1b", 4, 8), idle_time("zb_h1", 4, 8), idle_time("zbv", 4, 8, v=2)
        (9.0, 3.0, 1.5)
    """
    key = _check(schedule, p, m, v)
    if p == 1:
        return 0.0
    t = f + b + w
    if key in ("gpipe", "1f1b"):
        return (p - 1) * t
    if key == "interleaved_1f1b":
        return (v * max(m, p) + min(m, p) - 1 - v * m) * t / v
    if key == "zb_h1":
        return (p - 1) * max(0.0, f + b - w)
    if key == "zbv":
        return max(p - 1, 4 * p - 2 * m - 2) * t / (3 * v)
    return (p - 1) * t / (3 * v)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, f: float = 1.0, b: float = 1.0,
                    w: float = 1.0) -> float:
    """Share of wall time a rank idles: ``I / (m·(F + B + W) + I)``; with unit costs it equals
    :func:`lightning_4d.pipeline.schedules.bubble_theory` and the replay (:func:`replayed_bubble`).

    Example:
        >>> bubble_fraction("interleaved_1f1b", 4, 8, v=2)
        0.15789473684210525
        >>> round(bubble_fraction("zbv", 4, 8, v=2), 4), bubble_fraction("1f1b", 1, 8)
        (0.0588, 0.0)
    """
    idle = idle_time(schedule, p, m, v, f, b, w)
    return idle / (m * (f + b + w) + idle) if idle else 0.0


@lru_cache(maxsize=4096)
def replayed_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Bubble share of torch's own action table for the schedule, replayed under unit costs
    (:func:`lightning_4d.pipeline.bubble.bubble_from_actions`); 0 without pipelining. Cached.

    Example:
        >>> replayed_bubble("1f1b", 4, 8) == bubble_fraction("1f1b", 4, 8)
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
    key = _check(schedule, p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank} must be in [0, {p}).")
    if p == 1:
        return 1 if key != "gpipe" else m
    if key == "gpipe":
        return m
    if key in ("1f1b", "zb_h1"):
        return min(p - rank, m)
    if key == "interleaved_1f1b":
        return min(((v - 1) * p + 2 * (p - rank - 1) + 1) / v, m)
    if key == "zbv":
        return min(p, m)
    return min(p + 1, m)
