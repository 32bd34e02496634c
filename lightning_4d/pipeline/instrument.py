"""Timing of the real pipeline schedule step: compute actions and p2p waits, measured bubble.

:class:`PipelineInstrument` wraps, on this rank's ``PipelineStage`` objects, the three methods every
torch schedule calls for compute — ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I when
called with ``full_backward=False``) and ``backward_weight_one_chunk`` (W) — and, while a step
runs, the function through which every torch schedule waits on its send/receive work (torch
internals, both isolated in :func:`lightning_4d._compat.time_stage_compute` and
:func:`lightning_4d._compat.patch_p2p_wait`). Each becomes a :class:`PipelineEvent` ``(step, rank,
stage, kind, microbatch, t0, t1)``; the whole ``schedule.step`` is recorded as kind ``"step"``.

:func:`bubble_share` turns events (gathered from all pp ranks) into ``1 − busy / makespan`` per
rank or per stage, averaged over steps. On a CPU stage timestamps are ``time.perf_counter`` (``CLOCK_MONOTONIC``,
shared by processes of one host). On a CUDA stage the host only queues kernels, so each action is timed by CUDA
events on the stage's device instead, read after the step (one ``synchronize`` per instrumented step, before it, so
that the step's first event sits at the host's clock and ranks of one host compare); across hosts use
``makespan="rank"`` (each rank's own step span).

Example:
    >>> # not run: needs a process group
    >>> inst = PipelineInstrument.attach_to(runner)  # doctest: +SKIP
    >>> runner.train_step(x, y)  # doctest: +SKIP
    >>> bubble_share(inst.gather(runner.group), by="rank")  # doctest: +SKIP
    {0: 0.27, 1: 0.27, 2: 0.27, 3: 0.28}
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from lightning_4d import _compat

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from lightning_4d._compat.pipelining import PipelineSchedule
    from lightning_4d.pipeline.runner import PipelineRunner

__all__ = ["PipelineEvent", "PipelineInstrument", "bubble_share", "COMPUTE_KINDS"]

COMPUTE_KINDS = frozenset({"F", "B", "I", "W"})


@dataclass(frozen=True)
class PipelineEvent:
    """One timed interval on one rank: ``kind`` in ``F B I W`` (compute), ``wait`` (p2p) or ``step``.

    Example:
        >>> PipelineEvent(0, 1, 2, "F", 0, 0.0, 0.5).duration
        0.5
    """

    step: int
    rank: int
    stage: Optional[int]
    kind: str
    microbatch: Optional[int]
    t0: float
    t1: float

    @property
    def duration(self) -> float:
        """``t1 − t0`` in seconds."""
        return self.t1 - self.t0


class _HostClock:
    """Host seconds: a CPU stage computes while it is called."""

    def start(self) -> None:
        pass

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, mark: float) -> float:
        return mark


class _CudaClock:
    """CUDA events on ``device``'s current stream, turned into host seconds after the step: the step starts with a
    ``synchronize``, so its first event is at the host time read then, and every later one that much after it."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.base: Any = None
        self.base_host = 0.0

    def start(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        self.base_host = time.perf_counter()
        self.base = self.mark()

    def mark(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, mark: Any) -> float:
        mark.synchronize()
        return self.base_host + self.base.elapsed_time(mark) / 1e3  # elapsed_time: milliseconds


class PipelineInstrument:
    """Records :class:`PipelineEvent` objects for this rank's stages while the schedule steps.

    Args:
        stages: this rank's ``torch.distributed.pipelining.PipelineStage`` objects.
        schedule: the torch schedule driving them; its ``step`` (also used by ``eval``) is wrapped.

    Use :meth:`attach_to` for a :class:`~lightning_4d.pipeline.runner.PipelineRunner`; :meth:`detach`
    restores the original methods. Events accumulate in :attr:`events` until :meth:`clear`.

    Example:
        >>> # not run: needs a process group
        >>> inst = PipelineInstrument(runner.stages, runner.schedule)  # doctest: +SKIP
    """

    def __init__(self, stages: Sequence[PipelineStage], schedule: PipelineSchedule) -> None:
        self.stages = list(stages)
        self.schedule = schedule
        self.events: list[PipelineEvent] = []
        self.step_index = 0
        self.rank = int(self.stages[0].group_rank) if self.stages else 0
        device = getattr(self.stages[0], "device", None) if self.stages else None
        self.clock: Union[_HostClock, _CudaClock] = _CudaClock(device) if getattr(device, "type", None) == "cuda" \
            else _HostClock()
        self._pending: list[tuple[Optional[int], str, Optional[int], Any, Any]] = []  # marks of the running step
        self._patched: list[tuple[Union[PipelineStage, PipelineSchedule], str]] = []
        self._attach()

    @classmethod
    def attach_to(cls, runner: PipelineRunner) -> PipelineInstrument:
        """Instrument a :class:`~lightning_4d.pipeline.runner.PipelineRunner` (its ``stages`` and ``schedule``)."""
        return cls(runner.stages, runner.schedule)

    def _record(self, stage: Optional[int], kind: str, mb: Optional[int], t0: Any, t1: Any) -> None:
        self._pending.append((stage, kind, mb, t0, t1))

    def _resolve(self) -> None:
        """The running step's marks as :class:`PipelineEvent` s in seconds (CUDA events are read here)."""
        seconds = self.clock.seconds
        self.events.extend(PipelineEvent(self.step_index, self.rank, stage, kind, mb, seconds(t0), seconds(t1))
                           for stage, kind, mb, t0, t1 in self._pending)
        self._pending.clear()

    def _attach(self) -> None:
        for stage in self.stages:
            index = int(stage.stage_index)

            def on_compute(kind: str, chunk: int, t0: float, t1: float, index: int = index) -> None:
                self._record(index, kind, chunk, t0, t1)

            self._patched.extend((stage, name) for name in _compat.time_stage_compute(stage, on_compute,
                                                                                      self.clock.mark))

        def on_step(t0: Any, t1: Any) -> None:
            self._record(None, "step", None, t0, t1)
            self._resolve()
            self.step_index += 1

        wait = lambda a, b: self._record(None, "wait", None, a, b)  # noqa: E731
        self._patched.extend((self.schedule, n) for n in _compat.time_schedule_step(
            self.schedule, wait, on_step, self.clock.mark, self.clock.start))

    def detach(self) -> None:
        """Remove the wrappers (instance attributes), restoring torch's methods."""
        for obj, name in reversed(self._patched):
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
        self._patched.clear()

    def clear(self) -> None:
        """Forget recorded events (step numbering continues)."""
        self.events.clear()

    def gather(self, group: Optional[dist.ProcessGroup] = None) -> list[PipelineEvent]:
        """All pp ranks' events (``all_gather_object`` over ``group``); every rank gets the full list.

        Example:
            >>> # not run: needs a process group
            >>> events = inst.gather(runner.group)  # doctest: +SKIP
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            return list(self.events)
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, list(self.events), group=group)
        return [e for rank_events in out for e in rank_events]


def bubble_share(
    events: Sequence[PipelineEvent],
    by: Literal["rank", "stage"] = "rank",
    makespan: Literal["global", "rank"] = "global",
    skip_steps: int = 0,
) -> dict[int, float]:
    """Idle share ``1 − busy / makespan`` per rank (or stage), averaged over the recorded steps.

    ``busy`` sums the F/B/I/W intervals; ``makespan`` is the span of the step over all ranks
    (``"global"``, same host) or the rank's own step interval (``"rank"``). ``skip_steps`` drops
    the first steps (e.g. the one that ran torch's shape inference).

    Example:
        >>> ev = [PipelineEvent(0, 0, 0, "step", None, 0.0, 4.0), PipelineEvent(0, 0, 0, "F", 0, 0.0, 3.0)]
        >>> bubble_share(ev)
        {0: 0.25}
    """
    steps = sorted({e.step for e in events if e.kind == "step" and e.step >= skip_steps})
    if not steps:
        raise ValueError("no recorded 'step' events: run a schedule step with the instrument attached.")
    shares: dict[int, list[float]] = defaultdict(list)
    for step in steps:
        spans = [e for e in events if e.step == step and e.kind == "step"]
        global_span = max(e.t1 for e in spans) - min(e.t0 for e in spans)
        rank_span = {e.rank: e.duration for e in spans}
        busy: dict[int, float] = defaultdict(float)
        owner: dict[int, int] = {}
        for e in events:
            if e.step == step and e.kind in COMPUTE_KINDS:
                key = e.rank if by == "rank" else int(e.stage)  # type: ignore[arg-type]
                busy[key] += e.duration
                owner[key] = e.rank
        for key, value in busy.items():
            span = global_span if makespan == "global" else rank_span[owner[key]]
            shares[key].append(1.0 - value / span if span > 0 else 0.0)
    return {k: sum(v) / len(v) for k, v in sorted(shares.items())}
