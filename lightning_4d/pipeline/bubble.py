"""Bubble share of a schedule from torch's own action list, replayed under unit costs (pure).

:func:`bubble_from_actions` builds the torch schedule object without a process group, takes its
action table (``schedule.pipeline_order``) and replays it with the data dependencies of a
pipeline (zero-latency messages), giving each rank's idle share of the makespan.

Cost convention (per stage chunk): forward ``F = 1``, full backward ``B = 2``, input-gradient
backward ``I = 1``, weight-gradient backward ``W = 1`` (override with ``costs=``). For 1F1B the
bubble share is ``(p − 1)/(m + p − 1)`` for any uniform F/B ratio.

Example:
    >>> round(bubble_from_actions("1f1b", pp=4, virtual_stages=1, microbatches=8), 4)
    0.2727
    >>> bubble_from_actions("zbv", 4, 2, 8) < bubble_from_actions("1f1b", 4, 1, 8)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

from lightning_4d import _compat
from lightning_4d.pipeline.schedules import ScheduleInfo, get_schedule_info, validate_microbatches

__all__ = ["DEFAULT_COSTS", "Action", "SimulationResult", "schedule_actions", "simulate_actions",
           "bubble_from_actions"]

DEFAULT_COSTS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class Action(NamedTuple):
    """One compute action of a schedule: ``kind`` in ``F B I W``.

    Example:
        >>> Action(0, "F", 3)
        Action(stage=0, kind='F', microbatch=3)
    """

    stage: int
    kind: str
    microbatch: int


def _torch_pipeline_order(info: ScheduleInfo, pp: int, virtual_stages: int, microbatches: int) -> dict[int, list[Any]]:
    """torch's action table for the schedule, built without a process group
    (:func:`lightning_4d._compat.schedule_action_table`)."""
    return _compat.schedule_action_table(info.torch_class, pp, virtual_stages, microbatches, info.multi_stage)


def _flatten(action: Any) -> list[Action]:
    if action is None:
        return []
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [a for sub in subs for a in _flatten(sub)]
    kind = getattr(action.computation_type, "value", str(action.computation_type))
    if kind not in ("F", "B", "I", "W"):
        return []  # communication / FSDP / REDUCE_GRAD bookkeeping: no compute cost
    return [Action(int(action.stage_index), kind, int(action.microbatch_index))]


def schedule_actions(
    schedule: Union[str, type, ScheduleInfo], pp: int, virtual_stages: int, microbatches: int
) -> dict[int, list[Action]]:
    """Each rank's compute actions in execution order, taken from torch's schedule.

    Example:
        >>> [f"{a.kind}{a.microbatch}" for a in schedule_actions("1f1b", 2, 1, 3)[0]]
        ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    info = get_schedule_info(schedule)
    validate_microbatches(info, pp, virtual_stages, microbatches)
    order = _torch_pipeline_order(info, pp, virtual_stages, microbatches)
    acts = {rank: [a for act in order[rank] for a in _flatten(act)] for rank in sorted(order)}
    if not _complete(acts, pp * virtual_stages, microbatches) and not info.multi_stage:
        # Single-stage schedules execute a hand-written loop, not this table; in torch 2.x the
        # 1F1B table labels the last rank's forwards from 1 instead of 0. Both loops run each
        # stage's forwards in micro-batch order, so relabel them by occurrence.
        for rank, lst in acts.items():
            seen: dict[int, int] = {}
            for k, a in enumerate(lst):
                if a.kind == "F":
                    lst[k] = a._replace(microbatch=seen.get(a.stage, 0))
                    seen[a.stage] = seen.get(a.stage, 0) + 1
    if not _complete(acts, pp * virtual_stages, microbatches):
        raise ValueError(f"torch's {info.torch_name} action table for pp={pp}, m={microbatches} is incomplete.")
    return acts


def _complete(acts: dict[int, list[Action]], num_stages: int, m: int) -> bool:
    """Every stage runs F once per micro-batch and B (or I and W) once per micro-batch."""
    from collections import Counter

    count = Counter((a.stage, a.kind, a.microbatch) for lst in acts.values() for a in lst)
    for s in range(num_stages):
        for i in range(m):
            if count[(s, "F", i)] != 1:
                return False
            if count[(s, "B", i)] + count[(s, "I", i)] != 1 or count[(s, "I", i)] != count[(s, "W", i)]:
                return False
    return sum(count.values()) == sum(len(v) for v in acts.values()) and all(
        0 <= i < m for (_, _, i) in count)


@dataclass
class SimulationResult:
    """Replay of a schedule: per-rank busy time, the makespan and every action's ``(t0, t1)``."""

    makespan: float
    busy: dict[int, float]
    timeline: dict[int, list[tuple[Action, float, float]]]

    def bubble_by_rank(self) -> dict[int, float]:
        """Idle share of the makespan on each rank: ``1 − busy / makespan``."""
        return {r: 1.0 - b / self.makespan for r, b in self.busy.items()}

    @property
    def bubble(self) -> float:
        """Mean idle share over ranks."""
        shares = self.bubble_by_rank()
        return sum(shares.values()) / len(shares)


def simulate_actions(
    actions: dict[int, list[Action]], num_stages: int, costs: Optional[dict[str, float]] = None
) -> SimulationResult:
    """Replay per-rank action lists in order with zero-latency messages.

    An action starts when its rank is free and its inputs exist: ``F(s, i)`` needs ``F(s−1, i)``;
    ``B/I(s, i)`` needs ``F(s, i)`` and ``B/I(s+1, i)``; ``W(s, i)`` needs ``I(s, i)``.

    Example:
        >>> acts = schedule_actions("gpipe", 2, 1, 2)
        >>> simulate_actions(acts, 2).makespan
        9.0
    """
    cost = dict(DEFAULT_COSTS, **(costs or {}))
    done: dict[tuple[int, str, int], float] = {}
    pos = {r: 0 for r in actions}
    free = {r: 0.0 for r in actions}
    timeline: dict[int, list[tuple[Action, float, float]]] = {r: [] for r in actions}

    def ready_at(a: Action) -> Optional[float]:
        deps: list[tuple[int, str, int]] = []
        if a.kind == "F":
            if a.stage > 0:
                deps.append((a.stage - 1, "F", a.microbatch))
        elif a.kind in ("B", "I"):
            deps.append((a.stage, "F", a.microbatch))
            if a.stage < num_stages - 1:
                deps.append((a.stage + 1, "grad", a.microbatch))
        elif a.kind == "W":
            deps.append((a.stage, "I", a.microbatch))
        times = []
        for d in deps:
            if d not in done:
                return None
            times.append(done[d])
        return max(times, default=0.0)

    remaining = sum(len(v) for v in actions.values())
    while remaining:
        progress = False
        for r in sorted(actions):
            while pos[r] < len(actions[r]):
                a = actions[r][pos[r]]
                t = ready_at(a)
                if t is None:
                    break
                t0 = max(free[r], t)
                t1 = t0 + cost[a.kind]
                free[r] = t1
                done[(a.stage, a.kind, a.microbatch)] = t1
                if a.kind in ("B", "I"):
                    done[(a.stage, "grad", a.microbatch)] = t1
                timeline[r].append((a, t0, t1))
                pos[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {r: actions[r][pos[r]] for r in actions if pos[r] < len(actions[r])}
            raise ValueError(f"the schedule deadlocks: every rank waits, next actions {stuck}")
    makespan = max(free.values())
    busy = {r: sum(t1 - t0 for _, t0, t1 in timeline[r]) for r in actions}
    return SimulationResult(makespan, busy, timeline)


def bubble_from_actions(
    schedule: Union[str, type, ScheduleInfo],
    pp: int,
    virtual_stages: int,
    microbatches: int,
    costs: Optional[dict[str, float]] = None,
) -> float:
    """Bubble share (mean idle fraction of the makespan over ranks) of torch's own action list.

    Args:
        schedule: registry name or torch schedule class.
        pp: ranks; virtual_stages: stages per rank; microbatches: micro-batches per step.
        costs: per-action costs, default :data:`DEFAULT_COSTS` (F=1, B=2, I=1, W=1).

    Example:
        >>> abs(bubble_from_actions("1f1b", 4, 1, 4, costs={"F": 1, "B": 1}) - 3 / 7) < 1e-12
        True
    """
    info = get_schedule_info(schedule)
    acts = schedule_actions(info, pp, virtual_stages, microbatches)
    return simulate_actions(acts, pp * virtual_stages, costs).bubble

