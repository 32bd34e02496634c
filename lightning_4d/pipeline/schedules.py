"""Pipeline schedules: a registry over ``torch.distributed.pipelining``, micro-batch rules, theory.

Every schedule here is torch's own class; this module only names them and states their rules:

- :func:`validate_microbatches` (pure) applies the rules torch enforces (read from its source),
  plus "the local batch must split evenly", and raises ``ValueError`` naming value, rule and fix.
- :func:`bubble_theory` gives the closed-form bubble share of wall time (unit costs, see
  :mod:`lightning_4d.pipeline.bubble` for the replay of torch's own action lists).

Example:
    >>> get_schedule_info("1f1b").torch_class.__name__
    'Schedule1F1B'
    >>> validate_microbatches("interleaved_1f1b", pp=4, virtual_stages=2, microbatches=None, local_batch_size=16)
    8
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from lightning_4d.config import SCHEDULE_SHAPES
from lightning_4d.pipeline.partition import StageStyle

__all__ = [
    "ScheduleInfo",
    "SCHEDULES",
    "DEFAULT_SCHEDULE",
    "get_schedule_info",
    "minimum_microbatches",
    "default_microbatches",
    "validate_microbatches",
    "bubble_theory",
]

DEFAULT_SCHEDULE = "1f1b"


@dataclass(frozen=True)
class ScheduleInfo:
    """What lightning_4d knows about one torch schedule.

    Attributes:
        name: registry name (``"1f1b"``, ...).
        torch_name: class name in ``torch.distributed.pipelining``.
        split_backward: whether it splits the backward into input (I) and weight (W) passes.

    Its shape (``style``, ``virtual_stages``, ``multi_stage``) is read from the one table of schedule
    shapes, :data:`lightning_4d.config.SCHEDULE_SHAPES`.

    Example:
        >>> get_schedule_info("zbv").style
        'v'
    """

    name: str
    torch_name: str
    split_backward: bool

    @property
    def style(self) -> StageStyle:
        """Stage ↔ rank placement, ``"loop"`` or ``"v"``."""
        return SCHEDULE_SHAPES[self.name].style  # type: ignore[return-value]

    @property
    def virtual_stages(self) -> Optional[int]:
        """Required stages per rank (``None``: any ``>= 2``)."""
        return SCHEDULE_SHAPES[self.name].virtual_stages

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


SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo("gpipe", "ScheduleGPipe", False),
        ScheduleInfo("1f1b", "Schedule1F1B", False),
        ScheduleInfo("interleaved_1f1b", "ScheduleInterleaved1F1B", False),
        ScheduleInfo("looped_bfs", "ScheduleLoopedBFS", False),
        ScheduleInfo("interleaved_zb", "ScheduleInterleavedZeroBubble", True),
        ScheduleInfo("zbv", "ScheduleZBVZeroBubble", True),
        ScheduleInfo("dualpipev", "ScheduleDualPipeV", True),
    )
}
_ALIASES = {"1F1B": "1f1b", "interleaved": "interleaved_1f1b", "interleaved1f1b": "interleaved_1f1b",
            "zbvzerobubble": "zbv", "zb_v": "zbv", "dualpipe_v": "dualpipev", "loopedbfs": "looped_bfs",
            "interleavedzerobubble": "interleaved_zb"}


def get_schedule_info(schedule: Union[str, type, ScheduleInfo]) -> ScheduleInfo:
    """Look up a schedule by registry name, alias, or torch class.

    Example:
        >>> get_schedule_info("Interleaved").name
        'interleaved_1f1b'
    """
    if isinstance(schedule, ScheduleInfo):
        return schedule
    if isinstance(schedule, type):
        for info in SCHEDULES.values():
            if info.torch_name == schedule.__name__:
                return info
        raise ValueError(f"schedule class {schedule.__name__} is not in the registry; use one of {sorted(SCHEDULES)}.")
    key = str(schedule).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, _ALIASES.get(key.replace("_", ""), key))
    if key not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown. Choose one of {sorted(SCHEDULES)} (default '1f1b').")
    return SCHEDULES[key]


def _interleaved_ok(pp: int, m: int) -> bool:
    rounds = max(1, m // pp)
    return m % rounds == 0


def _rule_ok(info: ScheduleInfo, pp: int, v: int, m: int) -> bool:
    if info.name == "1f1b":
        return m >= pp
    if info.name in ("interleaved_1f1b", "interleaved_zb"):
        return _interleaved_ok(pp, m)
    if info.name == "dualpipev":
        return m >= pp * v
    return m >= 1


def _rule_text(info: ScheduleInfo, pp: int, v: int) -> str:
    if info.name == "1f1b":
        return f"1F1B needs at least as many micro-batches as stages (>= pp = {pp})"
    if info.name in ("interleaved_1f1b", "interleaved_zb"):
        return (f"{info.torch_name} runs rounds of micro-batches: with rounds = max(1, m // pp) the number m must "
                f"be a multiple of the rounds (pp = {pp})")
    if info.name == "dualpipev":
        return f"DualPipeV needs at least as many micro-batches as stages (>= 2·pp = {pp * v})"
    return "the number of micro-batches must be >= 1"


def minimum_microbatches(schedule: Union[str, type, ScheduleInfo], pp: int, virtual_stages: int = 1) -> int:
    """Smallest micro-batch count torch accepts for this schedule.

    Example:
        >>> minimum_microbatches("dualpipev", 4, 2)
        8
    """
    info = get_schedule_info(schedule)
    return next(m for m in range(1, 4 * pp * virtual_stages + 2) if _rule_ok(info, pp, virtual_stages, m))


def default_microbatches(schedule: Union[str, type, ScheduleInfo], pp: int, virtual_stages: int = 1) -> int:
    """Default micro-batch count: ``pp · virtual_stages`` (one per stage), or the schedule's minimum if larger.

    Example:
        >>> default_microbatches("1f1b", 4), default_microbatches("interleaved_1f1b", 4, 2)
        (4, 8)
    """
    info = get_schedule_info(schedule)
    m = max(pp * virtual_stages, minimum_microbatches(info, pp, virtual_stages))
    while not _rule_ok(info, pp, virtual_stages, m):
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
        return [m for m in range(1, top + 1) if _rule_ok(info, pp, virtual_stages, m)
                and (local_batch_size is None or local_batch_size % m == 0)]

    chosen_by_default = microbatches is None
    if microbatches is None:
        microbatches = default_microbatches(info, pp, virtual_stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a positive integer (or None for the default).")
    what = f"microbatches={microbatches}" + (" (the default pp·virtual_stages)" if chosen_by_default else "")
    if not _rule_ok(info, pp, virtual_stages, microbatches):
        raise ValueError(
            f"{what} is invalid for schedule {info.name!r} with pp={pp}: {_rule_text(info, pp, virtual_stages)}. "
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
    if info.name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if info.name in ("interleaved_1f1b", "looped_bfs"):
        makespan = v * max(m, p) + min(m, p) - 1
        return (makespan - v * m) / makespan
    if info.name == "zbv":
        makespan = max(3 * v * m + p - 1, 4 * (p + m) - 2)
        return (makespan - 3 * v * m) / makespan
    return (p - 1) / (3 * v * m + p - 1)
