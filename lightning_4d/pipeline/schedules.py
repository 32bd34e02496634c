"""Pipeline schedules: one record per schedule over ``torch.distributed.pipelining`` (pure).

Every schedule is torch's own class; its :class:`ScheduleInfo` is the one record of what the package knows about
it — the torch class, the placement (``"loop"`` or V-shaped), the stages per rank, the micro-batch rule (read from
torch's source), the bubble formula and the in-flight micro-batches — and :func:`get_schedule_info` is the one
place an unknown name is refused. The options (:mod:`lightning_4d.config`), the pipeline and the planner read the
record; nothing branches on a schedule's name elsewhere.

- :func:`validate_microbatches` applies the record's rule plus "the local batch must split evenly", and raises
  ``ValueError`` naming value, rule and fix.
- :func:`bubble_theory` gives the closed-form bubble share of wall time (unit costs, see
  :mod:`lightning_4d.pipeline.bubble` for the replay of torch's own action lists).

A new schedule is one more :class:`ScheduleInfo` in :data:`SCHEDULES` (``strategy=True`` once ``FourDStrategy`` runs
it under the parity tests).

Example:
    >>> get_schedule_info("1f1b").torch_class.__name__
    'Schedule1F1B'
    >>> validate_microbatches("interleaved_1f1b", pp=4, virtual_stages=2, microbatches=None, local_batch_size=16)
    8
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from lightning_4d.pipeline.partition import StageStyle

__all__ = [
    "ScheduleInfo",
    "SCHEDULES",
    "STRATEGY_SCHEDULES",
    "DEFAULT_SCHEDULE",
    "get_schedule_info",
    "default_virtual_stages",
    "stage_style",
    "minimum_microbatches",
    "default_microbatches",
    "validate_microbatches",
    "bubble_theory",
    "in_flight_microbatches",
]

DEFAULT_SCHEDULE = "1f1b"

#: ``(pp, virtual_stages, microbatches) -> bool``: whether torch accepts that many micro-batches.
MicrobatchRule = Callable[[int, int, int], bool]
#: ``(p, m, v) -> share``: the bubble's share of wall time under unit costs.
BubbleFormula = Callable[[int, int, int], float]
#: ``(p, m, rank, v) -> count``: micro-batches whose activations ``rank`` holds at its peak.
InFlight = Callable[[int, int, int, int], Union[int, float]]


@dataclass(frozen=True)
class ScheduleInfo:
    """What lightning_4d knows about one torch schedule: the one record of its facts.

    Attributes:
        name: registry name (``"1f1b"``, ...).
        torch_name: class name in ``torch.distributed.pipelining``.
        style: stage ↔ rank placement, ``"loop"`` (rank ``r`` holds ``r, r + pp, …``) or ``"v"`` (the stages
            zig-zag: rank 0 holds the first and the last; :mod:`lightning_4d.pipeline.partition`).
        virtual_stages: stages per rank the schedule requires; ``None``: any ``>= 2`` (default 2).
        split_backward: whether it splits the backward into input (I) and weight (W) passes.
        strategy: whether ``FourDStrategy`` runs it (the others feed the planner and the bubble replay only).
        rule: the micro-batch rule torch enforces, ``rule(pp, v, m)``; ``rule_text(pp, v)`` says it.
        bubble: the closed-form bubble share ``bubble(p, m, v)`` (:func:`bubble_theory`).
        in_flight: the in-flight micro-batch count ``in_flight(p, m, rank, v)``
            (:func:`in_flight_microbatches`); ``None``: not modelled.
        forwards_first: every forward of a step runs before any backward (GPipe): FSDP gathers each unit once
            for the forwards and once more for the backwards (:mod:`lightning_4d.planner.comm`).

    Example:
        >>> get_schedule_info("zbv").style, get_schedule_info("zbv").virtual_stages
        ('v', 2)
    """

    name: str
    torch_name: str
    style: StageStyle
    virtual_stages: Optional[int]
    split_backward: bool
    strategy: bool
    rule: MicrobatchRule = field(repr=False)
    rule_text: Callable[[int, int], str] = field(repr=False)
    bubble: BubbleFormula = field(repr=False)
    in_flight: Optional[InFlight] = field(default=None, repr=False)
    forwards_first: bool = False

    @property
    def multi_stage(self) -> bool:
        """Whether torch's class takes a list of stages per rank (``PipelineScheduleMulti``)."""
        return self.virtual_stages != 1

    @property
    def torch_class(self) -> type:
        """The torch schedule class (imported lazily)."""
        from torch.distributed import pipelining

        cls = getattr(pipelining, self.torch_name, None)
        if cls is None:
            raise ValueError(
                f"schedule {self.name!r} needs torch.distributed.pipelining.{self.torch_name}, which this torch "
                f"version does not provide. Upgrade torch or choose another schedule."
            )
        return cls

    def check_virtual_stages(self, virtual_stages: int) -> None:
        """Raise ``ValueError`` if this schedule cannot run ``virtual_stages`` stages per rank.

        Example:
            >>> get_schedule_info("1f1b").check_virtual_stages(1)
        """
        if self.virtual_stages is not None and virtual_stages != self.virtual_stages:
            raise ValueError(
                f"virtual_stages={virtual_stages} does not fit schedule {self.name!r}: it runs exactly "
                f"{self.virtual_stages} stage(s) per rank. Set virtual_stages={self.virtual_stages}"
                + (" or pick 'interleaved_1f1b' for several stages per rank." if self.virtual_stages == 1 else ".")
            )
        if self.virtual_stages is None and virtual_stages < 2:
            raise ValueError(
                f"virtual_stages={virtual_stages} does not fit schedule {self.name!r}: it interleaves several "
                f"stages per rank. Set virtual_stages >= 2, or use '1f1b' for one stage per rank."
            )


# ------------------------------------------------------------------------------------- micro-batch rules
def _any_count(pp: int, v: int, m: int) -> bool:
    return m >= 1


def _any_count_text(pp: int, v: int) -> str:
    return "the number of micro-batches must be >= 1"


def _rounds(pp: int, v: int, m: int) -> bool:
    return m % max(1, m // pp) == 0


def _rounds_text(torch_name: str) -> Callable[[int, int], str]:
    return lambda pp, v: (f"{torch_name} runs rounds of micro-batches: with rounds = max(1, m // pp) the number m "
                          f"must be a multiple of the rounds (pp = {pp})")


# ------------------------------------------------------------------------------------- bubble formulas
def _bubble_one_pass(p: int, m: int, v: int) -> float:  # GPipe, 1F1B: M = m + p − 1
    return (p - 1) / (m + p - 1)


def _bubble_interleaved(p: int, m: int, v: int) -> float:  # M = v·max(m, p) + min(m, p) − 1
    makespan = v * max(m, p) + min(m, p) - 1
    return (makespan - v * m) / makespan


def _bubble_zbv(p: int, m: int, v: int) -> float:  # M = max(3·v·m + p − 1, 4·(p + m) − 2)
    makespan = max(3 * v * m + p - 1, 4 * (p + m) - 2)
    return (makespan - 3 * v * m) / makespan


def _bubble_zero(p: int, m: int, v: int) -> float:  # steady state: only the start-up delay is idle
    return (p - 1) / (3 * v * m + p - 1)


SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo("gpipe", "ScheduleGPipe", "loop", 1, False, True, _any_count, _any_count_text,
                     _bubble_one_pass, in_flight=lambda p, m, rank, v: m, forwards_first=True),
        ScheduleInfo("1f1b", "Schedule1F1B", "loop", 1, False, True, lambda pp, v, m: m >= pp,
                     lambda pp, v: f"1F1B needs at least as many micro-batches as stages (>= pp = {pp})",
                     _bubble_one_pass, in_flight=lambda p, m, rank, v: min(p - rank, m)),
        ScheduleInfo("interleaved_1f1b", "ScheduleInterleaved1F1B", "loop", None, False, True, _rounds,
                     _rounds_text("ScheduleInterleaved1F1B"), _bubble_interleaved,
                     in_flight=lambda p, m, rank, v: min(((v - 1) * p + 2 * (p - rank - 1) + 1) / v, m)),
        ScheduleInfo("zbv", "ScheduleZBVZeroBubble", "v", 2, True, True, _any_count, _any_count_text, _bubble_zbv,
                     in_flight=lambda p, m, rank, v: min(p, m)),
        ScheduleInfo("dualpipev", "ScheduleDualPipeV", "v", 2, True, True, lambda pp, v, m: m >= pp * v,
                     lambda pp, v: f"DualPipeV needs at least as many micro-batches as stages (>= 2·pp = {pp * v})",
                     _bubble_zero, in_flight=lambda p, m, rank, v: min(p + 1, m) if p > 1 else 1),
        ScheduleInfo("looped_bfs", "ScheduleLoopedBFS", "loop", None, False, False, _any_count, _any_count_text,
                     _bubble_interleaved),
        ScheduleInfo("interleaved_zb", "ScheduleInterleavedZeroBubble", "loop", None, True, False, _rounds,
                     _rounds_text("ScheduleInterleavedZeroBubble"), _bubble_zero),
    )
}
#: The schedules ``FourDStrategy`` runs (``lightning_4d.config.SCHEDULES``).
STRATEGY_SCHEDULES: tuple[str, ...] = tuple(name for name, info in SCHEDULES.items() if info.strategy)
_ALIASES = {"1F1B": "1f1b", "interleaved": "interleaved_1f1b", "interleaved1f1b": "interleaved_1f1b",
            "zbvzerobubble": "zbv", "zb_v": "zbv", "dualpipe_v": "dualpipev", "loopedbfs": "looped_bfs",
            "interleavedzerobubble": "interleaved_zb"}


def get_schedule_info(schedule: Union[str, type, ScheduleInfo]) -> ScheduleInfo:
    """Look up a schedule by registry name, alias, or torch class: the one place an unknown schedule is refused.

    Example:
        >>> get_schedule_info("Interleaved").name
        'interleaved_1f1b'
        >>> get_schedule_info("2f2b")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: schedule='2f2b' is not known. Choose one of gpipe, 1f1b, interleaved_1f1b, zbv, dualpipev ...
    """
    if isinstance(schedule, ScheduleInfo):
        return schedule
    if isinstance(schedule, type):
        for info in SCHEDULES.values():
            if info.torch_name == schedule.__name__:
                return info
        schedule = schedule.__name__
    else:
        key = str(schedule).strip().lower().replace("-", "_")
        key = _ALIASES.get(key, _ALIASES.get(key.replace("_", ""), key))
        if key in SCHEDULES:
            return SCHEDULES[key]
    others = [name for name in SCHEDULES if name not in STRATEGY_SCHEDULES]
    raise ValueError(f"schedule={schedule!r} is not known. Choose one of {', '.join(STRATEGY_SCHEDULES)} (default "
                     f"{DEFAULT_SCHEDULE!r}; torch's {', '.join(others)}: the planner and the bubble replay only).")


def default_virtual_stages(schedule: Union[str, ScheduleInfo], pp: int) -> int:
    """Stages per rank when ``virtual_stages`` is not given: 1 without pipelining or for one-stage schedules,
    the required number for V schedules, else 2.

    Example:
        >>> default_virtual_stages("zbv", 4), default_virtual_stages("1f1b", 4), default_virtual_stages("zbv", 1)
        (2, 1, 1)
    """
    info = get_schedule_info(schedule)
    return 1 if pp == 1 else info.virtual_stages or 2


def stage_style(schedule: Union[str, ScheduleInfo], pp: int) -> StageStyle:
    """Stage placement of ``schedule`` on ``pp`` ranks: ``"v"`` for V-shaped schedules with a pipeline, else
    ``"loop"`` (one rank has nothing to zig-zag).

    Example:
        >>> stage_style("dualpipev", 4), stage_style("dualpipev", 1), stage_style("interleaved_1f1b", 4)
        ('v', 'loop', 'loop')
    """
    info = get_schedule_info(schedule)
    return info.style if pp > 1 else "loop"


def minimum_microbatches(schedule: Union[str, type, ScheduleInfo], pp: int, virtual_stages: int = 1) -> int:
    """Smallest micro-batch count torch accepts for this schedule.

    Example:
        >>> minimum_microbatches("dualpipev", 4, 2)
        8
    """
    info = get_schedule_info(schedule)
    return next(m for m in range(1, 4 * pp * virtual_stages + 2) if info.rule(pp, virtual_stages, m))


def default_microbatches(schedule: Union[str, type, ScheduleInfo], pp: int, virtual_stages: int = 1) -> int:
    """Default micro-batch count: ``pp · virtual_stages`` (one per stage), or the schedule's minimum if larger.

    Example:
        >>> default_microbatches("1f1b", 4), default_microbatches("interleaved_1f1b", 4, 2)
        (4, 8)
    """
    info = get_schedule_info(schedule)
    m = max(pp * virtual_stages, minimum_microbatches(info, pp, virtual_stages))
    while not info.rule(pp, virtual_stages, m):
        m += 1
    return m


def validate_microbatches(
    schedule: Union[str, type, ScheduleInfo],
    pp: int,
    virtual_stages: int,
    microbatches: Optional[int],
    local_batch_size: Optional[int] = None,
) -> int:
    """Check (or choose) the number of micro-batches; return it. Pure.

    Rules: ``microbatches`` is a positive integer (``None`` → :func:`default_microbatches`); the
    schedule's own rule from torch's source (1F1B: ``m >= pp``; interleaved: ``m`` a multiple of
    ``max(1, m // pp)``; DualPipeV: ``m >= 2·pp``; GPipe/ZBV: ``m >= 1``); and ``local_batch_size``
    (if given) splits evenly into ``m`` micro-batches. Errors name the value, the rule and valid choices.

    Example:
        >>> validate_microbatches("1f1b", pp=4, virtual_stages=1, microbatches=None, local_batch_size=8)
        4
        >>> validate_microbatches("1f1b", 4, 1, 3, 6)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: microbatches=3 is invalid for schedule '1f1b' with pp=4: 1F1B needs at least ... in [6].
    """
    info = get_schedule_info(schedule)
    for name, value in (("pp", pp), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    info.check_virtual_stages(virtual_stages)
    if local_batch_size is not None and (
        isinstance(local_batch_size, bool) or not isinstance(local_batch_size, int) or local_batch_size < 1
    ):
        raise ValueError(f"local_batch_size={local_batch_size!r} must be a positive integer.")

    def valid_choices() -> list[int]:
        top = local_batch_size if local_batch_size is not None else 4 * pp * virtual_stages
        return [m for m in range(1, top + 1) if info.rule(pp, virtual_stages, m)
                and (local_batch_size is None or local_batch_size % m == 0)]

    chosen_by_default = microbatches is None
    if microbatches is None:
        microbatches = default_microbatches(info, pp, virtual_stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a positive integer (or None for the default).")
    what = f"microbatches={microbatches}" + (" (the default pp·virtual_stages)" if chosen_by_default else "")
    if not info.rule(pp, virtual_stages, microbatches):
        raise ValueError(
            f"{what} is invalid for schedule {info.name!r} with pp={pp}: {info.rule_text(pp, virtual_stages)}. "
            f"Fix: use microbatches in {valid_choices() or '[none: change the batch size]'}."
        )
    if local_batch_size is not None and local_batch_size % microbatches != 0:
        raise ValueError(
            f"{what} does not divide the local batch size {local_batch_size}: the batch must split into equal "
            f"micro-batches. Fix: use microbatches in {valid_choices() or '[none]'} or a batch size that is a "
            f"multiple of {microbatches}."
        )
    return microbatches


def bubble_theory(schedule: Union[str, type, ScheduleInfo], p: int, m: int, v: int = 1) -> float:
    """Closed-form bubble share of wall time for uniform stages, equal to the replay of torch's own
    action table (:func:`lightning_4d.pipeline.bubble.bubble_from_actions`, costs ``F = I = W = 1``,
    ``B = 2`` per stage chunk; ``tests/unit/test_planner.py`` checks the two agree on a grid). This is the
    package's one bubble formula: the planner (:mod:`lightning_4d.planner.roofline`, ``report``) and the
    ``PipelineMonitor``'s theory value import it.

    With ``T`` the forward + backward cost of one micro-batch through one stage chunk, a rank works
    ``v·m·T`` and the makespan ``M`` (in units of ``T``) is:

    - GPipe, 1F1B: ``M = m + p − 1``, so the share is ``(p − 1)/(m + p − 1)``.
    - Interleaved 1F1B / looped BFS, ``v`` chunks per rank: ``M = v·max(m, p) + min(m, p) − 1``; for
      ``m >= p`` the share is ``(p − 1)/(v·m + p − 1)``; with fewer micro-batches than ranks each
      micro-batch still crosses all ``v·p`` chunks, so the pipeline never fills.
    - ZBV (``v = 2``, V placement, split backward ``I`` / ``W``): in units of one chunk pass
      (``F = I = W``), ``M = max(3·v·m + p − 1, 4·(p + m) − 2)``: in steady state only the start-up
      delay of ``p − 1`` chunk forwards is idle (Qi et al. 2024), ``(p − 1)/(3·v·m + p − 1)``;
      below about ``m = p + (p − 3)/2`` micro-batches torch's table cannot fill the warm-up (e.g.
      83% idle for ``p = 8, m = 1``).
    - DualPipeV (``m >= 2p``, torch's rule) and interleaved zero bubble: ``(p − 1)/(3·v·m + p − 1)``;
      torch's interleaved ZB table reaches it for ``m >= p`` only (below, use the replay).

    Example:
        >>> bubble_theory("1f1b", 4, 8)
        0.2727272727272727
        >>> bubble_theory("interleaved_1f1b", 4, 8, 2)
        0.15789473684210525
        >>> round(bubble_theory("zbv", 8, 1, 2), 3), round(bubble_theory("zbv", 4, 8, 2), 4)
        (0.824, 0.0588)
    """
    info = get_schedule_info(schedule)
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p={p}, m={m}, v={v} must all be >= 1.")
    if p > 1:
        info.check_virtual_stages(v)
    return info.bubble(p, m, v)


def in_flight_microbatches(schedule: Union[str, ScheduleInfo], p: int, m: int, rank: int,
                           v: int = 1) -> Union[int, float]:
    """Peak number of micro-batches whose activations rank ``rank`` of ``p`` holds, in units of one micro-batch
    through all of the rank's layers (the planner's activation memory and FSDP gather passes):

    - GPipe: ``m`` (all forwards before any backward);
    - 1F1B: ``min(p − i, m)``;
    - interleaved 1F1B (Megatron's warm-up of ``(v − 1)·p + 2·(p − i − 1)`` chunk micro-batches, plus
      the one in flight): ``min(((v − 1)·p + 2·(p − i − 1) + 1) / v, m)``;
    - ZBV: ``min(p, m)`` on every rank (same peak as 1F1B's first rank, balanced by the V placement);
    - DualPipeV: ``min(p + 1, m)`` (DeepSeek-V3 report: ``PP + 1`` micro-batches of activations).

    Example:
        >>> [in_flight_microbatches("1f1b", 4, 8, r) for r in range(4)]
        [4, 3, 2, 1]
        >>> in_flight_microbatches("interleaved_1f1b", 4, 8, 0, v=2)
        5.5
    """
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    info = get_schedule_info(schedule)
    if info.in_flight is None:
        raise ValueError(f"schedule={info.name!r}: the planner has no in-flight micro-batch count for it; use one "
                         f"of {STRATEGY_SCHEDULES}.")
    if p > 1:
        info.check_virtual_stages(v)
    if not 0 <= rank < p:
        raise ValueError(f"rank={rank} must be in [0, {p}).")
    return info.in_flight(p, m, rank, v)
