"""Measured pipeline bubble per stage and rank, next to the schedule's theory; Chrome trace and PNG timeline.

Everything measured comes from :class:`~lightning_4d.pipeline.instrument.PipelineInstrument` events
of the real ``schedule.step`` (F / B / I / W compute intervals and the step span on each pp rank);
only ``pp/bubble_fraction_theory`` comes from a formula
(:func:`~lightning_4d.pipeline.schedules.bubble_theory`).

Bubble fraction = ``1 − busy / makespan`` (:func:`~lightning_4d.pipeline.instrument.bubble_share`):
per rank (``busy`` = its compute time) and per stage (``busy`` = that stage's compute time; with
several stages per rank a stage also "idles" while its rank runs the other one); the overall value
is the mean over ranks, as in the theory. ``makespan`` is the step span over all pp ranks
(``"global"``: same host, one monotonic clock) or each rank's own step span (``"rank"``; chosen
automatically when the pp ranks are on different hosts).

Example:
    >>> ev = [PipelineEvent(0, 0, 0, "step", None, 0.0, 4.0), PipelineEvent(0, 0, 0, "F", 0, 0.0, 3.0)]
    >>> bubble_stats(ev).overall
    0.25
    >>> sorted(chrome_trace(ev)["traceEvents"][-1].items())[:3]
    [('args', {'stage': None, 'step': 0}), ('cat', 'bubble'), ('dur', 1000000.0)]
"""

from __future__ import annotations

import json
import os
import socket
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_4d.callbacks._common import (
    RunContext,
    every_n,
    gather_rows,
    internal_comm,
    log_metrics,
    new_figure,
    resolve_every_n,
    resolve_output_dir,
)
from lightning_4d.pipeline.instrument import COMPUTE_KINDS, PipelineEvent, PipelineInstrument, bubble_share

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import STEP_OUTPUT

    from lightning_4d.pipeline.runner import PipelineRunner

__all__ = ["BubbleStats", "PipelineBubbleMonitor", "bubble_stats", "chrome_trace", "idle_intervals",
           "plot_timeline", "write_trace"]

Makespan = Literal["global", "rank"]

# forward dark, backward light (input-gradient and weight-gradient halves lighter still), idle blank
COLORS = {"F": "#08306b", "B": "#6baed6", "I": "#9ecae1", "W": "#c6dbef"}


@dataclass
class BubbleStats:
    """Measured bubble of one or more steps.

    Attributes:
        overall: mean over ranks of the per-rank bubble fraction.
        per_rank / per_stage: ``{pp rank: fraction}`` / ``{stage: fraction}``.
        makespan: mean step span in seconds.
    """

    overall: float
    per_rank: dict[int, float] = field(default_factory=dict)
    per_stage: dict[int, float] = field(default_factory=dict)
    makespan: float = 0.0


def _steps(events: Sequence[PipelineEvent]) -> list[int]:
    return sorted({e.step for e in events if e.kind == "step"})


def _span(events: Sequence[PipelineEvent], step: int, makespan: Makespan, rank: int) -> tuple[float, float]:
    spans = [e for e in events if e.step == step and e.kind == "step" and (makespan == "global" or e.rank == rank)]
    return min(e.t0 for e in spans), max(e.t1 for e in spans)


def bubble_stats(events: Sequence[PipelineEvent], makespan: Makespan = "global") -> BubbleStats:
    """Per-rank and per-stage bubble fractions of instrumented steps (all pp ranks' events).

    Example:
        >>> ev = [PipelineEvent(0, r, r, "step", None, 0.0, 2.0) for r in (0, 1)]
        >>> ev += [PipelineEvent(0, 0, 0, "F", 0, 0.0, 1.0), PipelineEvent(0, 1, 1, "F", 0, 1.0, 2.0)]
        >>> s = bubble_stats(ev); s.overall, s.per_stage
        (0.5, {0: 0.5, 1: 0.5})
    """
    per_rank = bubble_share(events, by="rank", makespan=makespan)
    per_stage = bubble_share(events, by="stage", makespan=makespan)
    spans = []
    for step in _steps(events):
        t0, t1 = _span(events, step, "global", 0)
        spans.append(t1 - t0)
    overall = sum(per_rank.values()) / len(per_rank) if per_rank else 0.0
    return BubbleStats(overall, per_rank, per_stage, sum(spans) / len(spans) if spans else 0.0)


def idle_intervals(events: Sequence[PipelineEvent], makespan: Makespan = "global") -> list[PipelineEvent]:
    """The gaps between one rank's compute intervals within the step's makespan, as ``"idle"`` events.

    Example:
        >>> ev = [PipelineEvent(0, 0, 0, "step", None, 0.0, 3.0), PipelineEvent(0, 0, 0, "F", 0, 1.0, 2.0)]
        >>> [(e.t0, e.t1) for e in idle_intervals(ev)]
        [(0.0, 1.0), (2.0, 3.0)]
    """
    out: list[PipelineEvent] = []
    ranks = sorted({e.rank for e in events})
    for step in _steps(events):
        for rank in ranks:
            if not any(e.step == step and e.rank == rank and e.kind == "step" for e in events) and makespan == "rank":
                continue
            t_start, t_end = _span(events, step, makespan, rank)
            busy = sorted((e.t0, e.t1) for e in events
                          if e.step == step and e.rank == rank and e.kind in COMPUTE_KINDS)
            cursor = t_start
            for t0, t1 in busy:
                if t0 > cursor:
                    out.append(PipelineEvent(step, rank, None, "idle", None, cursor, t0))
                cursor = max(cursor, t1)
            if t_end > cursor:
                out.append(PipelineEvent(step, rank, None, "idle", None, cursor, t_end))
    return out


def chrome_trace(events: Sequence[PipelineEvent], makespan: Makespan = "global",
                 metadata: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one complete event (``ph="X"``)
    per executed action, named ``F`` / ``B`` / ``I`` / ``W``, plus ``idle`` gaps; ``pid`` is the pp rank,
    timestamps in microseconds from the first step's start; stage and micro-batch in ``args``.

    Example:
        >>> ev = [PipelineEvent(0, 0, 0, "step", None, 0.0, 1.0), PipelineEvent(0, 0, 0, "F", 0, 0.0, 1.0)]
        >>> [e["name"] for e in chrome_trace(ev)["traceEvents"] if e["ph"] == "X"]
        ['F']
    """
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    idle = idle_intervals(events, makespan)
    t_origin = min((e.t0 for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        stages = sorted({e.stage for e in compute if e.rank == rank and e.stage is not None})
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                      "args": {"name": f"pp rank {rank} (stage{'s' if len(stages) > 1 else ''} "
                                       f"{', '.join(map(str, stages))})"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for e in sorted(compute, key=lambda e: (e.rank, e.t0)):
        trace.append({"name": e.kind, "cat": "compute", "ph": "X", "pid": e.rank, "tid": 0,
                      "ts": (e.t0 - t_origin) * 1e6, "dur": e.duration * 1e6,
                      "args": {"stage": e.stage, "microbatch": e.microbatch, "step": e.step}})
    for e in idle:
        trace.append({"name": "idle", "cat": "bubble", "ph": "X", "pid": e.rank, "tid": 0,
                      "ts": (e.t0 - t_origin) * 1e6, "dur": e.duration * 1e6,
                      "args": {"stage": None, "step": e.step}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_trace(events: Sequence[PipelineEvent], path: str, makespan: Makespan = "global",
                metadata: Optional[dict[str, Any]] = None) -> str:
    """Write :func:`chrome_trace` as JSON to ``path`` (directories created); returns ``path``.

    Example:
        >>> # not run: needs files (writes a trace)
        >>> write_trace(events, "trace.json")  # doctest: +SKIP
        'trace.json'
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(chrome_trace(events, makespan, metadata), fh)
    return path


def plot_timeline(events: Sequence[PipelineEvent], path: str, title: str = "") -> Optional[str]:
    """PNG timeline: pp ranks (rows, rank 0 on top) × milliseconds; forward dark, backward light
    (I / W lighter), idle blank, micro-batch numbers on wide bars. ``None`` without matplotlib.

    Example:
        >>> # not run: needs files (writes a PNG)
        >>> plot_timeline(events, "timeline.png", "1F1B p=4 m=8")  # doctest: +SKIP
        'timeline.png'
    """
    fig = new_figure(figsize=(10, 1.0 + 0.55 * max(1, len({e.rank for e in events}))), dpi=100)
    if fig is None:
        return None
    ax = fig.add_subplot(1, 1, 1)
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    ranks = sorted({e.rank for e in events})
    t_origin = min((e.t0 for e in events), default=0.0)
    t_end = max((e.t1 for e in events), default=0.0)
    for e in compute:
        y = ranks.index(e.rank)
        x0, width = (e.t0 - t_origin) * 1e3, e.duration * 1e3
        ax.broken_barh([(x0, width)], (y - 0.4, 0.8), facecolors=COLORS.get(e.kind, "#999999"),
                       edgecolors="white", linewidth=0.5)
        if e.microbatch is not None and width > (t_end - t_origin) * 1e3 / 60:
            ax.text(x0 + width / 2, y, str(e.microbatch), ha="center", va="center", fontsize=7,
                    color="white" if e.kind == "F" else "black")
    stages = {r: sorted({e.stage for e in compute if e.rank == r and e.stage is not None}) for r in ranks}
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" + (f" (stages {', '.join(map(str, stages[r]))})" if len(stages[r]) > 1 else "")
                        for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, (t_end - t_origin) * 1e3)
    ax.set_xlabel("time in step (ms)")
    from matplotlib.patches import Patch

    kinds = [k for k in ("F", "B", "I", "W") if any(e.kind == k for e in compute)]
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds] + [Patch(facecolor="white",
              edgecolor="#bbbbbb", label="idle")], loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              ncol=len(kinds) + 1, frameon=False)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


# ---------------------------------------------------------------------------------------------- per-step rows
def _local_row(events: Sequence[PipelineEvent], num_stages: int, replica: int, pp_rank: int) -> torch.Tensor:
    """``[valid, replica, pp rank, step t0, step t1, busy of stage 0..S-1, busy of rank]`` for this rank."""
    row = torch.zeros(6 + num_stages, dtype=torch.float64)
    spans = [e for e in events if e.kind == "step"]
    if not spans:
        return row
    row[0], row[1], row[2] = 1.0, float(replica), float(pp_rank)
    row[3], row[4] = min(e.t0 for e in spans), max(e.t1 for e in spans)
    for e in events:
        if e.kind in COMPUTE_KINDS:
            if e.stage is not None and 0 <= int(e.stage) < num_stages:
                row[5 + int(e.stage)] += e.duration
            row[5 + num_stages] += e.duration
    return row


def _stats_from_rows(rows: torch.Tensor, num_stages: int, makespan: Makespan) -> Optional[BubbleStats]:
    """Bubble per rank / stage from gathered rows, averaged over replicas (dp × tp copies of the pipeline)."""
    per_rank: dict[int, list[float]] = defaultdict(list)
    per_stage: dict[int, list[float]] = defaultdict(list)
    spans: list[float] = []
    for replica in sorted({int(r[1]) for r in rows if r[0] > 0}):
        mine = [r for r in rows if r[0] > 0 and int(r[1]) == replica]
        events: list[PipelineEvent] = []
        for r in mine:
            rank = int(r[2])
            events.append(PipelineEvent(0, rank, None, "step", None, float(r[3]), float(r[4])))
            for s in range(num_stages):
                if r[5 + s] > 0:
                    events.append(PipelineEvent(0, rank, s, "F", None, 0.0, float(r[5 + s])))
        for k, v in bubble_share(events, by="rank", makespan=makespan).items():
            per_rank[k].append(v)
        for k, v in bubble_share(events, by="stage", makespan=makespan).items():
            per_stage[k].append(v)
        spans.append(max(float(r[4]) for r in mine) - min(float(r[3]) for r in mine))
    if not per_rank:
        return None
    rank_mean = {k: sum(v) / len(v) for k, v in sorted(per_rank.items())}
    return BubbleStats(sum(rank_mean.values()) / len(rank_mean), rank_mean,
                       {k: sum(v) / len(v) for k, v in sorted(per_stage.items())}, sum(spans) / len(spans))


# ---------------------------------------------------------------------------------------------- callback
class PipelineBubbleMonitor(Callback):
    """Logs the measured pipeline bubble of the training step next to the schedule's theory and writes
    Chrome traces and PNG timelines of the step.

    Attaches a :class:`~lightning_4d.pipeline.instrument.PipelineInstrument` to the strategy's pipeline
    runner (``trainer.strategy.plan.pipeline``) at the start of training and detaches it at the end.
    Per recorded step (averaged over the data/tensor-parallel copies of the pipeline):

    - ``pp/bubble_fraction`` (mean over pp ranks), ``pp/bubble_fraction_rank{r}``,
      ``pp/bubble_fraction_stage{i}``, ``pp/step_seconds`` (makespan);
    - ``pp/bubble_fraction_theory``: the schedule's closed form for ``p``, ``m``, ``v``.

    Every ``trace_every_n_steps`` batches, global rank 0 writes ``pipeline_step{N}.json`` (Chrome /
    Perfetto trace) and ``pipeline_step{N}.png`` (timeline) into ``dirpath`` (default
    ``<trainer.log_dir>/pipeline``), ``N`` counting training batches from the start of fit. A no-op
    without pipeline parallelism.

    Args:
        every_n_steps: record every N training batches (default: ``trainer.log_every_n_steps``).
        trace_every_n_steps: write a trace and a timeline every N training batches (0: never).
        dirpath: where to write them.
        makespan: ``"auto"`` (``"global"`` when all ranks share a host, else ``"rank"``), ``"global"``, ``"rank"``.
        skip_first: training batches not recorded at the start of fit (the first runs torch's shape inference).

    Attributes:
        last: the :class:`BubbleStats` of the last recorded step; ``written``: paths written so far.

    Example:
        >>> monitor = PipelineBubbleMonitor(every_n_steps=10, trace_every_n_steps=100)
        >>> # not run: needs a Trainer
        >>> trainer = L.Trainer(strategy=FourDStrategy(pp=4, microbatches=8), callbacks=[monitor])  # doctest: +SKIP
        >>> trainer.fit(lm, data)  # doctest: +SKIP
        >>> float(trainer.callback_metrics["pp/bubble_fraction"])  # doctest: +SKIP
        0.29
    """

    def __init__(self, every_n_steps: Optional[int] = None, trace_every_n_steps: int = 100,
                 dirpath: Optional[str] = None, makespan: str = "auto", skip_first: int = 1) -> None:
        super().__init__()
        if makespan not in ("auto", "global", "rank"):
            raise ValueError(f"makespan={makespan!r} must be 'auto', 'global' or 'rank'.")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1 (or None for trainer.log_every_n_steps).")
        if trace_every_n_steps < 0 or skip_first < 0:
            raise ValueError("trace_every_n_steps and skip_first must be >= 0.")
        self.every_n_steps = every_n_steps
        self.trace_every_n_steps = trace_every_n_steps
        self.dirpath = dirpath
        self.makespan = makespan
        self.skip_first = skip_first
        self.last: Optional[BubbleStats] = None
        self.written: list[str] = []
        self.instrument: Optional[PipelineInstrument] = None
        self._runner: Optional[PipelineRunner] = None
        self._ctx: Optional[RunContext] = None
        self._every = 1
        self._mode: Makespan = "global"
        self._dir: Optional[str] = None
        self._seen = 0

    # -- lifecycle -------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._ctx = RunContext.from_trainer(trainer)
        self._every = resolve_every_n(self.every_n_steps, trainer)
        if self._ctx.degree("pp") > 1:
            self._dir = resolve_output_dir(trainer, self.dirpath, "pipeline")  # broadcasts: every rank
            self._mode = self._resolve_makespan()

    def _resolve_makespan(self) -> Makespan:
        if self.makespan != "auto":
            return self.makespan  # type: ignore[return-value]
        import torch.distributed as dist

        if not dist.is_initialized():
            return "global"
        hosts: list[Optional[str]] = [None] * dist.get_world_size()
        with internal_comm():
            dist.all_gather_object(hosts, socket.gethostname())
        return "global" if len(set(hosts)) == 1 else "rank"

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._ctx is None or self._ctx.degree("pp") == 1:
            return
        runner = getattr(trainer.strategy.plan, "pipeline", None)
        if runner is None:
            rank_zero_warn("PipelineBubbleMonitor: pp > 1 but the strategy exposes no pipeline runner "
                           "(trainer.strategy.plan.pipeline); nothing is measured.")
            return
        self.attach(runner)

    def attach(self, runner: PipelineRunner) -> None:
        """Instrument a :class:`~lightning_4d.pipeline.runner.PipelineRunner` (done in ``on_train_start``)."""
        self.detach()
        self._runner = runner
        self.instrument = PipelineInstrument.attach_to(runner)

    def detach(self) -> None:
        """Remove the instrumentation (done at the end of training)."""
        if self.instrument is not None:
            self.instrument.detach()
        self.instrument, self._runner = None, None

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.detach()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self.detach()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.detach()

    # -- steps -----------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.instrument is not None:
            self.instrument.clear()  # drop validation / previous steps: only this batch's events remain

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
        if self.instrument is None:
            return
        step = self._seen  # training batches before this one (since the start of fit)
        self._seen += 1
        if step < self.skip_first:
            return
        record = every_n(self._every, step)
        trace = self.trace_every_n_steps > 0 and every_n(self.trace_every_n_steps, step)
        if not (record or trace):
            return
        events = list(self.instrument.events)
        stats = self.record(pl_module, events)
        if trace:
            self._write(events, stats, step)

    def record(self, pl_module: "pl.LightningModule", events: Sequence[PipelineEvent]) -> Optional[BubbleStats]:
        """Aggregate this rank's events of one step over all ranks and log the metrics (collective).

        Example:
            >>> # not run: needs a Trainer
            >>> monitor.record(pl_module, instrument.events)  # doctest: +SKIP
        """
        runner, ctx = self._runner, self._ctx
        assert runner is not None and ctx is not None
        num_stages = int(runner.num_stages)
        replica = ctx.coordinate("dp") * ctx.degree("tp") + ctx.coordinate("tp")
        row = _local_row(events, num_stages, replica, int(runner.pp_rank))
        device = getattr(pl_module, "device", None)
        stats = _stats_from_rows(gather_rows(row, device), num_stages, self._mode)
        if stats is None:
            return None
        self.last = stats
        from lightning_4d.pipeline.schedules import bubble_theory

        metrics = {"pp/bubble_fraction": stats.overall, "pp/step_seconds": stats.makespan,
                   "pp/bubble_fraction_theory": bubble_theory(runner.info, int(runner.pp), int(runner.microbatches),
                                                              int(runner.virtual_stages))}
        metrics.update({f"pp/bubble_fraction_rank{k}": v for k, v in stats.per_rank.items()})
        metrics.update({f"pp/bubble_fraction_stage{k}": v for k, v in stats.per_stage.items()})
        log_metrics(pl_module, metrics)
        return stats

    def _write(self, events: Sequence[PipelineEvent], stats: Optional[BubbleStats], step: int) -> None:
        ctx, runner = self._ctx, self._runner
        assert ctx is not None and runner is not None and self.instrument is not None
        if ctx.coordinate("dp") != 0 or ctx.coordinate("tp") != 0:
            return  # one pipeline copy (the one with global rank 0) is traced
        with internal_comm():
            all_events = self.instrument.gather(runner.group)
        if int(runner.pp_rank) != 0 or self._dir is None:
            return
        from lightning_4d.pipeline.schedules import bubble_theory

        theory = bubble_theory(runner.info, int(runner.pp), int(runner.microbatches), int(runner.virtual_stages))
        meta = {"schedule": runner.info.name, "pp": int(runner.pp), "microbatches": int(runner.microbatches),
                "virtual_stages": int(runner.virtual_stages), "bubble_fraction_theory": theory,
                "bubble_fraction": stats.overall if stats else None, "step": step}
        base = os.path.join(self._dir, f"pipeline_step{step}")
        self.written.append(write_trace(all_events, base + ".json", self._mode, meta))
        measured = f"{stats.overall:.3f}" if stats else "n/a"
        title = (f"{runner.info.name}  p={runner.pp}  m={runner.microbatches}  v={runner.virtual_stages}   "
                 f"bubble measured {measured}, theory {theory:.3f}")
        png = plot_timeline(all_events, base + ".png", title)
        if png is not None:
            self.written.append(png)
