"""Internals of ``torch.distributed.pipelining`` schedules: the p2p-wait hook, the stage methods they call
for compute, runtime action tables, schedules built without a process group.

Example:
    >>> from torch.distributed.pipelining import Schedule1F1B
    >>> [str(a) for a in schedule_action_table(Schedule1F1B, 2, 1, 2, multi_stage=False)[0]][:4]
    ['0F0', '0F1', '0B0', '0B1']
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Union

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    # any torch schedule: their common base ``_PipelineSchedule`` is private
    PipelineSchedule = Union[PipelineScheduleSingle, PipelineScheduleMulti]

__all__ = ["forward_only_actions", "patch_p2p_wait", "schedule_action_table", "time_schedule_step", "time_stage_compute"]


@contextlib.contextmanager
def patch_p2p_wait(on_wait: Callable[[Any, Any], None], clock: Callable[[], Any] = time.perf_counter
                   ) -> Iterator[None]:
    """Report ``(t0, t1)`` of every p2p wait of torch's schedules to ``on_wait`` while the block runs (the marks
    ``clock()`` returns: host seconds by default).

    All torch schedules (single-stage loops and the multi-stage runtime) block on send/receive work
    only through the private module-level ``_wait_batch_p2p(works)`` of
    ``torch.distributed.pipelining.schedules``, which they look up at call time; it is replaced for
    the duration of the block. A torch without it: nothing is reported.
    """
    from torch.distributed.pipelining import schedules as torch_schedules

    original = getattr(torch_schedules, "_wait_batch_p2p", None)
    if original is None:
        yield
        return

    @functools.wraps(original)
    def timed_wait(work: list[dist.Work], *args: Any, **kwargs: Any) -> None:
        if not work:
            return original(work, *args, **kwargs)
        t0 = clock()
        try:
            return original(work, *args, **kwargs)
        finally:
            on_wait(t0, clock())

    torch_schedules._wait_batch_p2p = timed_wait
    try:
        yield
    finally:
        torch_schedules._wait_batch_p2p = original


@contextlib.contextmanager
def forward_only_actions(schedule: PipelineSchedule) -> Iterator[None]:
    """Run a multi-stage schedule's action table without backward actions while the block runs.

    ``schedule.eval()`` of torch's runtime schedules still walks the backward actions (as no-ops);
    with the V placement (ZBV, DualPipeV) two adjacent stages share a rank and their local gradient
    hand-off raises "can't steal_bwd_input if this stage doesn't have backward" (torch 2.13). This
    swaps the runtime's internal ``pipeline_order_with_comms`` table for a copy keeping only forward
    compute and forward send/recv (the forward halves of overlapped F+B actions), then restores it.
    Schedules without that table run unchanged.
    """
    table = getattr(schedule, "pipeline_order_with_comms", None)
    if not table:
        yield
        return
    keep = {"F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD"}
    filtered: dict[int, list[Any]] = {}
    for rank, actions in table.items():
        out: list[Any] = []
        for action in actions:
            subs = getattr(action, "sub_actions", None)
            if subs:
                out.extend(sub for sub in subs if sub.computation_type.value == "F")
            elif action.computation_type.value in keep:
                out.append(action)
        filtered[rank] = out
    schedule.pipeline_order_with_comms = filtered
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = table


def schedule_action_table(
    torch_class: type, pp: int, virtual_stages: int, microbatches: int, multi_stage: bool
) -> dict[int, list[Any]]:
    """Build torch schedule ``torch_class`` without a process group and return its action table
    (``schedule.pipeline_order``: rank → actions, ``None`` entries for idle slots).

    torch computes the whole table in the constructor and reads only ``num_stages``, ``group_size``,
    ``group_rank``, ``stage_index`` and ``submod`` from its stages there, so duck-typed stand-ins
    suffice (torch's own private ``_schedule_visualizer.get_schedule_ops`` does the same with mocks).
    torch's own validation errors (``ValueError`` / ``AssertionError``) propagate.

    Raises:
        ValueError: when this torch's schedule exposes no ``pipeline_order``.
    """
    from types import SimpleNamespace

    num_stages = pp * virtual_stages

    def stub(i: int) -> SimpleNamespace:
        return SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0, submod=None, stage_index=i)

    stages: Union[list[SimpleNamespace], SimpleNamespace] = (
        [stub(i) for i in range(virtual_stages)] if multi_stage else stub(0))
    sched = torch_class(stages, microbatches)
    order = getattr(sched, "pipeline_order", None)
    if order is None:
        raise ValueError(f"torch's {torch_class.__name__} exposes no action list (pipeline_order) in this version.")
    return order


def time_stage_compute(stage: PipelineStage, on_compute: Callable[[str, int, Any, Any], None],
                       clock: Callable[[], Any] = time.perf_counter) -> list[str]:
    """Report ``(kind, microbatch, t0, t1)`` of every compute action torch's schedules run on ``stage`` (the marks
    ``clock()`` returns: host seconds by default).

    Wraps, as instance attributes, the ``PipelineStage`` methods the schedules call for compute
    (defined on the private base ``_PipelineStageBase``): ``forward_one_chunk`` (``"F"``),
    ``backward_one_chunk`` (``"B"``, or ``"I"`` when called with ``full_backward=False``, its second
    parameter) and ``backward_weight_one_chunk`` (``"W"``); backward calls on a stage without backward
    (eval) are not reported. Returns the wrapped attribute names: ``delattr(stage, name)`` restores
    torch's method.
    """

    def timed(name: str, kind_of: Callable[[tuple, dict], str], backward: bool) -> None:
        orig = getattr(stage, name)

        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            if backward and not stage.has_backward:
                return orig(chunk, *args, **kwargs)
            kind = kind_of(args, kwargs)
            t0 = clock()
            try:
                return orig(chunk, *args, **kwargs)
            finally:
                on_compute(kind, chunk, t0, clock())

        setattr(stage, name, run)

    def backward_kind(args: tuple, kwargs: dict) -> str:
        return "B" if kwargs.get("full_backward", args[1] if len(args) > 1 else True) else "I"

    timed("forward_one_chunk", lambda a, k: "F", backward=False)
    timed("backward_one_chunk", backward_kind, backward=True)
    timed("backward_weight_one_chunk", lambda a, k: "W", backward=True)
    return ["forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"]


def time_schedule_step(schedule: PipelineSchedule, on_wait: Callable[[Any, Any], None],
                       on_step: Callable[[Any, Any], None], clock: Callable[[], Any] = time.perf_counter,
                       on_start: Callable[[], None] = lambda: None) -> list[str]:
    """Report every p2p wait inside ``schedule.step`` (:func:`patch_p2p_wait`) and the whole step's
    ``(t0, t1)`` (after the step, also when it raises), as marks of ``clock()``; ``on_start()`` runs first.

    Wraps ``step`` as an instance attribute of ``schedule`` (torch's schedules have no step hooks;
    ``eval`` calls ``step`` too). Returns the wrapped names: ``delattr(schedule, name)`` restores it.
    """
    orig = schedule.step

    def step(*args: Any, **kwargs: Any) -> Any:
        on_start()
        t0 = clock()
        try:
            with patch_p2p_wait(on_wait, clock):
                return orig(*args, **kwargs)
        finally:
            on_step(t0, clock())

    schedule.step = step
    return ["step"]
