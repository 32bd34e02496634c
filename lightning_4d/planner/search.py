"""Layout search: every valid (tp, cp, pp, ep, dp, micro-batches, schedule) for a model on a cluster,
the ones that fit ranked by estimated step time.

Candidates: ``tp`` a divisor of the world no larger than a node that divides the head and kv-head
counts; ``pp`` a divisor of ``world / tp`` with ``pp · v`` stages no more than the layers; ``cp`` (context
parallelism) a divisor of ``world / (tp · pp)`` among the ``context_parallel`` choices (default
:data:`CP_CHOICES`), above 1 only when the spec's attention can be split and the sequence cuts into ``2·cp`` zigzag chunks (``cp·tp`` tokens each
under sequence parallelism: :meth:`~lightning_4d.planner.spec.TransformerSpec.cp_refusal`); ``dp =
world / (tp · cp · pp)`` dividing the global batch; ``ep`` a divisor of ``dp · cp · tp`` and of the expert count
(1 for dense models); every schedule ``FourDStrategy`` runs (``lightning_4d.pipeline.schedules.STRATEGY_SCHEDULES``) (``1f1b`` only when
``pp = 1``); micro-batch counts that split the local batch evenly and satisfy the schedule's rule
(``lightning_4d.pipeline.schedules.validate_microbatches``); sequence parallelism on and off (``tp > 1``),
every data-parallel mode (fsdp, replicate, hsdp, zero1, zero2) and activation checkpointing (none,
selective, full). Each is validated as the strategy validates it (``lightning_4d.config.FourDConfig``),
so only layouts the runtime accepts are proposed (``runtime_only=False`` also plans the modes the
runtime does not offer yet). Step times use the bubble of the exact schedule (equal to the replay of
torch's action table, :mod:`lightning_4d.planner.bubble`).

A candidate fits when its peak rank memory is at most the device's usable memory. The fitting ones
are ranked by :func:`~lightning_4d.planner.roofline.estimate_step`; each of the top ones gets a
reason: why the first wins, and where each other one loses time against it. If nothing fits,
:class:`NoLayoutFits` names the smallest peak memory any layout needs.

Example:
    >>> from lightning_4d.planner.spec import TransformerSpec, TrainSpec
    >>> from lightning_4d.planner.hardware import ClusterSpec, CPU_TOY
    >>> spec = TransformerSpec(vocab_size=256, hidden=64, layers=4, heads=4, seq_len=32)
    >>> best = search(spec, ClusterSpec(1, 4, CPU_TOY), TrainSpec(global_batch_size=16))[0]
    >>> (best.dims.tp, best.dims.pp, best.dims.dp), best.reason.startswith("fastest")
    ((1, 1, 4), True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence

from lightning_4d.pipeline.schedules import default_virtual_stages
from lightning_4d.mesh import ParallelDims, _divisors
from lightning_4d.pipeline.schedules import get_schedule_info
from lightning_4d.planner.comm import comm_per_rank
from lightning_4d.planner.hardware import ClusterSpec, axes_crossing_nodes
from lightning_4d.planner.memory import check_layout, memory_per_rank, stage_layout
from lightning_4d.planner.roofline import StepEstimate, estimate_step
from lightning_4d.planner.spec import DATA_PARALLEL_MODES, TrainSpec, TransformerSpec

__all__ = ["CP_CHOICES", "Candidate", "NoLayoutFits", "enumerate_layouts", "search"]

_GB = 1e9


class NoLayoutFits(ValueError):
    """No layout of the model fits the cluster's device memory (the message names the smallest need)."""


@dataclass(frozen=True)
class Candidate:
    """One evaluated layout: degrees, training options, peak memory, estimate and (for the top ones) a reason."""

    dims: ParallelDims
    train: TrainSpec
    peak_memory: float
    fits: bool
    estimate: Optional[StepEstimate] = None
    reason: str = ""

    @property
    def label(self) -> str:
        """Short text: ``tp=8 pp=4 ep=8 dp=4 m=16 1f1b`` (``cp=2`` after ``tp`` with context parallelism)."""
        d = self.dims
        cp = f"cp={d.cp} " if d.cp > 1 else ""
        return (f"tp={d.tp} {cp}pp={d.pp} ep={d.ep} dp={d.dp} m={self.train.microbatches} "
                f"{self.train.schedule if d.pp > 1 else '-'}")

    def as_dict(self) -> dict:
        """Plain dict for JSON."""
        d = self.dims
        return {"tp": d.tp, "cp": d.cp, "pp": d.pp, "ep": d.ep, "dp": d.dp, "edp": d.edp,
                "virtual_stages": d.virtual_stages,
                "sequence_parallel": d.sequence_parallel, "microbatches": self.train.microbatches,
                "schedule": self.train.schedule, "peak_memory": self.peak_memory, "fits": self.fits,
                "step_s": self.estimate.step_s if self.estimate else None,
                "mfu": self.estimate.mfu if self.estimate else None, "reason": self.reason}


def _microbatch_choices(schedule: str, pp: int, v: int, local_batch: int) -> list[int]:
    if pp == 1:
        return _divisors(local_batch)
    from lightning_4d.pipeline.schedules import validate_microbatches

    out = []
    for m in _divisors(local_batch):
        try:
            validate_microbatches(schedule, pp, v, m, local_batch)
        except ValueError:
            continue
        out.append(m)
    return out


def _runtime_accepts(world: int, tp: int, pp: int, ep: int, sp: bool, m: int, schedule: str, v: int,
                     data_parallel: str, ac: Optional[str], dp_shard: Optional[int], cp: int = 1
                     ) -> Optional[ParallelDims]:
    """The layout as the strategy validates it (``lightning_4d.config.FourDConfig``), or ``None``."""
    from lightning_4d.config import FourDConfig

    kwargs = {"dp_shard": dp_shard} if dp_shard is not None else {}
    try:
        cfg = FourDConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=sp, microbatches=m if pp > 1 else None,
                          schedule=schedule, virtual_stages=v if pp > 1 else None, data_parallel=data_parallel,
                          activation_checkpointing=ac, cp=cp, **kwargs)
        return cfg.resolve(world)
    except (ValueError, NotImplementedError, TypeError):
        return None


def _node_shard(dp: int, tp: int, gpus_per_node: int, cp: int = 1) -> Optional[int]:
    """HSDP shard group ``dp_shard``: the largest divisor of ``dp`` whose ranks (``dp_shard × cp × tp``: with context
    parallelism FSDP2 shards over ``dp_shard × cp``) fit in one node; ``None`` when that is all of dp, or a single
    rank without cp (HSDP would be FSDP or replicate)."""
    k = max(d for d in _divisors(dp) if d * cp * tp <= max(gpus_per_node, cp * tp))
    return k if (1 if cp > 1 else 2) <= k < dp else None


#: Options the search varies besides the degrees, schedule and micro-batches.
AC_CHOICES = (None, "selective", "full")
#: Context-parallel degrees the search tries by default (``None``: every divisor of the world; ``(1,)``: none).
CP_CHOICES = (1, 2, 4, 8)
DP_CHOICES = DATA_PARALLEL_MODES


def enumerate_layouts(spec: TransformerSpec, cluster: ClusterSpec, train: TrainSpec,
                      schedules: Optional[Sequence[str]] = None, max_tp: Optional[int] = None,
                      activation_checkpointing: Sequence[Optional[str]] = AC_CHOICES,
                      sequence_parallel: Sequence[bool] = (True, False),
                      data_parallel: Sequence[str] = DP_CHOICES, runtime_only: bool = True,
                      context_parallel: Optional[Sequence[int]] = CP_CHOICES
                      ) -> Iterator[tuple[ParallelDims, TrainSpec]]:
    """Every valid ``(ParallelDims, TrainSpec)`` pair (module docstring); ``train``'s micro-batches, schedule,
    data-parallel mode, activation checkpointing are replaced by each candidate's. With ``runtime_only``
    (default) a layout must pass the strategy's own validation (``FourDConfig``): data-parallel modes the
    runtime does not offer (ZeRO-1/2) are skipped; without it they are planned. ``context_parallel``: the cp
    degrees tried (``None``: every divisor of the world; ``(1,)``: none).

    Example:
        >>> from lightning_4d.planner.spec import TransformerSpec, TrainSpec
        >>> spec = TransformerSpec(vocab_size=8, hidden=8, layers=2, heads=2, seq_len=4)
        >>> sorted({(d.tp, d.cp, d.pp) for d, _ in enumerate_layouts(spec, ClusterSpec(1, 2), TrainSpec(2))})
        [(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1)]
    """
    from lightning_4d.pipeline.schedules import STRATEGY_SCHEDULES as SCHEDULES

    world = cluster.world_size
    schedules = tuple(schedules) if schedules is not None else SCHEDULES
    max_tp = max_tp or cluster.gpus_per_node
    seq = train.seq(spec)
    for tp in _divisors(world):
        if tp > max_tp or spec.heads % tp or spec.kv_heads % tp:
            continue
        for pp in _divisors(world // tp):
            for cp in _divisors(world // (tp * pp)):
                if (context_parallel is not None and cp not in context_parallel) or spec.cp_refusal(cp, seq):
                    continue
                dp = world // (tp * pp * cp)
                if train.global_batch_size % dp:
                    continue
                yield from _with_options(spec, cluster, train, tp, pp, cp, dp, schedules, activation_checkpointing,
                                         sequence_parallel, data_parallel, runtime_only)


def _with_options(spec: TransformerSpec, cluster: ClusterSpec, train: TrainSpec, tp: int, pp: int, cp: int, dp: int,
                  schedules: Sequence[str], activation_checkpointing: Sequence[Optional[str]],
                  sequence_parallel: Sequence[bool], data_parallel: Sequence[str], runtime_only: bool
                  ) -> Iterator[tuple[ParallelDims, TrainSpec]]:
    """The layouts of degrees ``(tp, pp, cp, dp)``: every ep, schedule, sequence parallelism, data-parallel mode,
    activation checkpointing and micro-batch count the runtime accepts (:func:`enumerate_layouts`)."""
    world = cluster.world_size
    local = train.global_batch_size // dp
    eps = [e for e in _divisors(dp * cp * tp) if spec.num_experts % e == 0] if spec.is_moe else [1]
    for schedule in (schedules if pp > 1 else ("1f1b",)):
        v = default_virtual_stages(schedule, pp)
        if pp * v > spec.layers:
            continue
        for ep in eps:
            for sp in (sequence_parallel if tp > 1 else (True,)):
                if cp > 1 and sp and spec.cp_refusal(cp, train.seq(spec), tp):
                    continue  # each rank's T/cp tokens do not split again over tp
                for mode in (data_parallel if dp * cp > 1 or ep < tp else ("fsdp",)):
                    shard = _node_shard(dp, tp, cluster.gpus_per_node, cp) if mode == "hsdp" else None
                    if mode == "hsdp" and shard is None:
                        continue
                    for ac in activation_checkpointing:
                        for m in _microbatch_choices(schedule, pp, v, local):
                            if runtime_only:
                                dims = _runtime_accepts(world, tp, pp, ep, sp, m, schedule, v, mode, ac, shard, cp)
                            else:
                                try:
                                    dims = ParallelDims.from_world(world, tp=tp, pp=pp, ep=ep, sequence_parallel=sp,
                                                                   virtual_stages=v, cp=cp)
                                except ValueError:
                                    dims = None
                            if dims is None:
                                break
                            try:
                                check_layout(spec, dims)
                            except ValueError:
                                break
                            if (spec.tied_embeddings and dims.dp_cp > 1 and pp > 1
                                    and get_schedule_info(schedule).style == "v"):
                                break  # refused by the runtime (derive_plan.check_tied_across_v_stages)
                            yield dims, train.with_(microbatches=m, schedule=schedule, data_parallel=mode,
                                                    activation_checkpointing=ac, dp_shard=shard)


def _reason(c: Candidate, best: Candidate, device_bytes: float) -> str:
    e, b = c.estimate, best.estimate
    mem = (f"peak {c.peak_memory / _GB:.1f} of {device_bytes / _GB:.1f} GB; dp={c.train.data_parallel}, "
           f"AC={c.train.activation_checkpointing or 'none'}, SP={'on' if c.dims.sp else 'off'}, "
           f"bubble {e.bubble:.1%} (replayed schedule)")
    if c is best:
        parts = ", ".join(f"{k} {v / e.step_s:.0%}" for k, v in sorted(e.parts.items(), key=lambda kv: -kv[1])
                          if v / e.step_s >= 0.01)
        crossing = [a for a, x in e.crossing.items() if x and getattr(c.dims, a) > 1]
        return (f"fastest: step {e.step_s:.3g} s, MFU {e.mfu:.1%}; time: {parts}; axes across nodes: "
                f"{', '.join(crossing) or 'none'}; {mem}")
    deltas = {k: e.parts[k] - b.parts.get(k, 0.0) for k in e.parts}
    worst = max(deltas, key=deltas.get)
    if e.step_s - b.step_s <= 1e-3 * b.step_s:
        return f"as fast as #1 (step {e.step_s:.3g} s, MFU {e.mfu:.1%}) but ranked after it on memory; {mem}"
    why = {"compute": "more compute on the slowest rank (uneven stages, the head, expert imbalance)",
           "comm_tp": "more TP traffic", "comm_cp": "more context-parallel K/V traffic",
           "comm_ep": "more expert all-to-all traffic", "comm_pp": "more pipeline sends",
           "bubble": f"a larger pipeline bubble ({e.bubble:.1%} vs {b.bubble:.1%})",
           "dp_exposed": "data-parallel traffic not hidden behind compute",
           "optimizer": "a larger optimizer step (less sharded states)"}[worst]
    axes = {"comm_tp": ("tp",), "comm_cp": ("cp",), "comm_ep": ("ep",), "comm_pp": ("pp",),
            "dp_exposed": ("dp", "edp")}.get(worst, ())
    cross = [a for a in axes if e.crossing.get(a) and getattr(c.dims, a) > 1]
    extra = f" ({', '.join(cross)} crosses nodes)" if cross else ""
    return (f"{e.step_s / b.step_s - 1:.1%} slower than #1: +{deltas[worst]:.3g} s from {why}{extra}; "
            f"MFU {e.mfu:.1%}; {mem}")


def search(spec: TransformerSpec, cluster: ClusterSpec, train: TrainSpec, top: int = 5,
           schedules: Optional[Sequence[str]] = None, max_tp: Optional[int] = None, distinct: bool = True,
           activation_checkpointing: Sequence[Optional[str]] = AC_CHOICES,
           sequence_parallel: Sequence[bool] = (True, False), data_parallel: Sequence[str] = DP_CHOICES,
           runtime_only: bool = True, context_parallel: Optional[Sequence[int]] = CP_CHOICES) -> list[Candidate]:
    """The ``top`` fastest fitting layouts, each with a reason string.

    With ``distinct`` (default) only the fastest schedule / micro-batch count of each ``(tp, cp, pp, ep)``
    is listed, so the top five show five different degree choices. ``context_parallel``: the cp degrees tried
    (:func:`enumerate_layouts`; each only where the model and the sequence allow it; ``None``: every divisor).

    Raises:
        NoLayoutFits: nothing fits; the message names the smallest peak memory needed and its layout.
        ValueError: no valid layout exists at all (e.g. the global batch does not split).

    Example:
        >>> from lightning_4d.planner.spec import seed_moe_1t, TrainSpec
        >>> from lightning_4d.planner.hardware import ClusterSpec, H100
        >>> search(seed_moe_1t(), ClusterSpec(1, 8, H100), TrainSpec(global_batch_size=8))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.planner.search.NoLayoutFits: No layout of seed_moe_1t fits 1 node(s) × 8 H100-SXM-80GB: ...
    """
    usable = cluster.device.usable_bytes
    fitting: list[Candidate] = []
    smallest: Optional[Candidate] = None
    crossing_cache: dict[tuple, dict] = {}
    count = 0
    overhead = cluster.device.allocator_overhead
    for dims, tr in enumerate_layouts(spec, cluster, train, schedules, max_tp, activation_checkpointing,
                                      sequence_parallel, data_parallel, runtime_only, context_parallel):
        count += 1
        layout = stage_layout(spec, dims, tr.schedule)
        try:
            peak = max(r.peak for r in memory_per_rank(spec, dims, tr, layout, overhead,
                                                         cluster.device.runtime_bytes))
        except ValueError:  # e.g. an HSDP shard group that does not divide dp
            continue
        cand = Candidate(dims, tr, peak, peak <= usable)
        if smallest is None or peak < smallest.peak_memory:
            smallest = cand
        if not cand.fits:
            continue
        key = (dims.tp, dims.cp, dims.pp, dims.ep)
        if key not in crossing_cache:
            crossing_cache[key] = axes_crossing_nodes(dims, cluster)
        native = tr.data_parallel in ("fsdp", "replicate")
        est = estimate_step(spec, dims, tr, cluster, comm_per_rank(spec, dims, tr, layout) if native else None,
                            layout, crossing_cache[key])
        fitting.append(Candidate(dims, tr, peak, True, est))
    where = f"{cluster.nodes} node(s) × {cluster.gpus_per_node} {cluster.device.name}"
    if smallest is None:
        raise ValueError(f"No valid layout of {spec.name or 'the model'} exists on {where} for global batch "
                         f"{train.global_batch_size}: it must split over dp, heads over tp, experts over ep and "
                         f"layers over pipeline stages. Change the global batch size or the world size.")
    if not fitting:
        need = smallest.peak_memory
        raise NoLayoutFits(
            f"No layout of {spec.name or 'the model'} fits {where}: {count} layouts tried; the smallest peak "
            f"memory is {need / _GB:.1f} GB per device ({smallest.label}) but a device offers "
            f"{usable / _GB:.1f} GB usable ({cluster.device.memory_bytes / _GB:.0f} GB × "
            f"{cluster.device.usable_fraction:g}). Needs a device with at least "
            f"{need / cluster.device.usable_fraction / _GB:.1f} GB, or more GPUs, activation checkpointing or a "
            f"smaller global batch.")
    fitting.sort(key=lambda c: (c.estimate.step_s, c.peak_memory))
    chosen: list[Candidate] = []
    seen: set[tuple] = set()
    for c in fitting:
        key = ((c.dims.tp, c.dims.cp, c.dims.pp, c.dims.ep) if distinct
               else (c.label, c.dims.sp, c.train.data_parallel, c.train.activation_checkpointing))
        if key not in seen:
            seen.add(key)
            chosen.append(c)
        if len(chosen) == top:
            break
    return [replace(c, reason=_reason(c, chosen[0], usable)) for c in chosen]
