"""Step time and MFU estimate: compute from FLOPs, communication from bytes and link bandwidths, bubble.

Per pipeline rank (the slowest one sets the pace):

- ``compute``: :func:`lightning_4d.planner.compute.rank_compute_time` — every GEMM at an efficiency
  that rises with its arithmetic intensity, the attention core, memory-bound kernels at the HBM
  bandwidth and the recomputed forward of activation checkpointing. ``rank_flops`` (the rank's
  share of the step's FLOPs: its layers' ``6·N_active + 12·a·d·s`` per token, experts
  ``6·k·N_expert·ι`` for the busiest ep rank, the head on the last stage) is reported alongside.
- ``comm[axis] = Σ bytes_sent / bandwidth(axis) + calls · latency(axis)``, with NVLink bandwidth for
  axes inside a node and the NIC's across nodes (:func:`~lightning_4d.planner.hardware.axes_crossing_nodes`).
- tp, cp (K/V), ep and pp traffic sit on the critical path; FSDP / replicate traffic overlaps with compute
  and only its excess shows: ``dp_exposed = max(0, comm_dp + comm_edp − compute)``.
- ``step = (compute + comm_tp + comm_cp + comm_ep + comm_pp) / (1 − bubble) + dp_exposed + optimizer`` with the
  bubble of the exact schedule (:func:`~lightning_4d.pipeline.schedules.bubble_theory`: the closed form
  equal to the replay of torch's action table) and the AdamW step at the HBM bandwidth. HSDP / ZeRO traffic comes from
  :mod:`~lightning_4d.planner.dp_modes`.
- ``MFU = 6·N_active·tokens + attention (model FLOPs, no recomputation) / (world · peak · step)``.
- CPU ranks sharing fewer cores than ranks (``DeviceSpec.cores``): the step is at least the node's ranks' own
  work over its cores plus the communication nothing hides (:func:`shared_cores_step`).

Kernel launch gaps and stragglers are not modelled; the constants of
:class:`~lightning_4d.planner.hardware.DeviceSpec` are calibrated against published runs
(``docs/planner_calibration.md``).

Example:
    >>> from lightning_4d.planner.spec import TransformerSpec, TrainSpec
    >>> from lightning_4d.planner.hardware import ClusterSpec, CPU_TOY
    >>> from lightning_4d.mesh import ParallelDims
    >>> spec = TransformerSpec(vocab_size=64, hidden=32, layers=2, heads=4, seq_len=16)
    >>> est = estimate_step(spec, ParallelDims(1), TrainSpec(global_batch_size=4), ClusterSpec(1, 1, CPU_TOY))
    >>> est.mfu > 0.5, est.bubble
    (True, 0.0)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from lightning_4d.pipeline.schedules import stage_style
from lightning_4d.mesh import ParallelDims
from lightning_4d.models.flops import training_flops_per_token
from lightning_4d.pipeline.partition import stage_to_rank
from lightning_4d.pipeline.schedules import bubble_theory
from lightning_4d.planner.bubble import replayed_bubble
from lightning_4d.planner.comm import Collective, comm_per_rank
from lightning_4d.planner.hardware import ClusterSpec, axes_crossing_nodes
from lightning_4d.planner.compute import optimizer_seconds, rank_compute_time
from lightning_4d.planner.memory import micro_batch_size, resolve_microbatches, stage_layout
from lightning_4d.planner.spec import TrainSpec, TransformerSpec

__all__ = ["StepEstimate", "rank_flops", "estimate_step", "comm_seconds", "shared_cores_step"]

_CRITICAL = ("tp", "cp", "ep", "pp")  # on the critical path (cp: the K/V all-gathers / reduce-scatters)


@dataclass(frozen=True)
class StepEstimate:
    """Estimated time of one optimizer step (seconds) for the slowest pipeline rank.

    ``parts`` splits ``step_s`` into compute, tp / ep / pp communication, bubble and exposed dp time.
    """

    model_flops: float
    rank_flops: float
    compute_s: float
    comm_s: dict
    bubble: float
    dp_exposed_s: float
    step_s: float
    mfu: float
    tokens_per_s: float
    crossing: dict
    parts: dict
    slowest_pp_rank: int
    compute_parts: dict = field(default_factory=dict)

    @property
    def bottleneck(self) -> str:
        """The largest part of the step."""
        return max(self.parts, key=self.parts.get)

    def as_dict(self) -> dict:
        """Plain dict (with ``bottleneck``)."""
        return {**asdict(self), "bottleneck": self.bottleneck}


def rank_flops(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec, layers: list[int], last: bool,
               recompute: bool = True) -> float:
    """FLOPs one rank computes per step (see the module docstring).

    Example:
        >>> from lightning_4d.planner.spec import TransformerSpec, TrainSpec
        >>> spec = TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, ffn_hidden=4, seq_len=2)
        >>> rank_flops(spec, ParallelDims(1), TrainSpec(global_batch_size=1), [0], True) == spec.flops_per_token() * 2
        True
    """
    s, h = train.seq(spec), spec.hidden
    tokens = train.global_batch_size * s / (dims.dp * dims.cp * dims.tp)
    active = 0.0  # matmul parameters a token goes through on this rank
    for i in layers:
        lp = spec.layer_params(i)
        dense = lp["attention"] + lp["dense_mlp"] + lp["router"] + lp["shared_experts"]
        experts = spec.top_k * spec.expert_params() * train.expert_imbalance if spec.is_moe_layer(i) else 0
        active += dense + lp["norms"] + experts
    if last:
        active += h * spec.vocab_size + spec.norm_params
    width = spec.heads * spec.head_dim
    per_token = training_flops_per_token(active, len(layers), width, s)
    extra = 0.0  # forwards run again in backward: a third of forward + backward
    if recompute and train.activation_checkpointing == "full":
        extra = per_token / 3
    elif recompute and train.activation_checkpointing == "selective":
        extra = training_flops_per_token(0.0, len(layers), width, s) / 3
    return tokens * (per_token + extra)


def comm_seconds(records: list[Collective], dims: ParallelDims, cluster: ClusterSpec,
                 crossing: Optional[dict] = None) -> dict[str, float]:
    """Seconds of communication per axis for one rank's collectives.

    Example:
        >>> from lightning_4d.planner.hardware import ClusterSpec, H100
        >>> recs = [Collective("tp", "all_reduce", "x", 1, 450e9, 2)]
        >>> round(comm_seconds(recs, ParallelDims(2, tp=2), ClusterSpec(1, 2, H100))["tp"], 6)
        1.00001
    """
    crossing = crossing if crossing is not None else axes_crossing_nodes(dims, cluster)
    d = cluster.device
    out = {a: 0.0 for a in ("tp", "cp", "pp", "ep", "dp", "edp")}
    for rec in records:
        inter = crossing.get(rec.axis, False)
        bw, lat = (d.inter_node_bw, d.latency_inter) if inter else (d.intra_node_bw, d.latency_intra)
        axis = "dp" if rec.axis in ("dp_shard", "dp_replicate", "dp_cp") else rec.axis  # HSDP's two dp axes, dp × cp
        if d.latency_dp is not None and axis in ("dp", "edp"):
            lat = d.latency_dp
        out[axis] += rec.bytes_sent / bw + (rec.calls * lat if rec.bytes_sent else 0.0)
    return out


def _dp_mode_seconds(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec, cluster: ClusterSpec,
                     layers: list[int], first: bool, last: bool, m: int) -> dict[str, float]:
    """Data-parallel seconds of one rank for hsdp / zero1 / zero2 (:mod:`.dp_modes`): the shard group's
    traffic inside a node when it fits there, the replicas' across nodes."""
    from lightning_4d.layout.data_parallel import wrap_mode
    from lightning_4d.planner.dp_modes import dp_traffic, hsdp_groups
    from lightning_4d.planner.memory import local_params

    lp = local_params(spec, dims, layers, first, last)
    d = cluster.device
    out = {"dp": 0.0, "edp": 0.0}
    for axis, params, n, units in (("dp", lp["dense"], dims.dp_cp, len(layers) + 1),
                                   ("edp", lp["experts"], dims.edp, sum(1 for e in lp["layer_experts"] if e))):
        if n == 1 or not params:
            continue
        shard = None
        mode = wrap_mode(train.data_parallel, experts=True) if axis == "edp" else train.data_parallel
        if mode == "hsdp":
            per_node = max(1, cluster.gpus_per_node // dims.tp)
            shard = train.dp_shard or dims.dp_shard or min(n, per_node)
            shard = hsdp_groups(n, shard)[1]
            inside = shard * dims.tp <= cluster.gpus_per_node
        else:
            inside = n * (dims.tp if axis == "dp" else dims.ep) <= cluster.gpus_per_node
        passes = 1 if dims.pp > 1 else 2
        tr = dp_traffic(mode, params, n, m, passes, shard, train.act_bytes, units)
        bw_shard = d.intra_node_bw if inside else d.inter_node_bw
        out[axis] = (tr.shard_bytes / bw_shard + tr.replica_bytes / d.inter_node_bw
                     + tr.calls * (d.latency_intra if inside else d.latency_inter))
    return out


def estimate_step(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec, cluster: ClusterSpec,
                  records: Optional[list[list[Collective]]] = None, layout: Optional[list[list[int]]] = None,
                  crossing: Optional[dict] = None, replay: bool = False) -> StepEstimate:
    """Step time, MFU and throughput of a layout (see the module docstring).

    ``replay=True`` takes the bubble from the replay of torch's action table instead of its closed form
    (they are equal; the replay is slower).

    Example:
        >>> from lightning_4d.planner.spec import seed_moe_1t
        >>> from lightning_4d.planner.hardware import ClusterSpec, H200
        >>> est = estimate_step(seed_moe_1t(), ParallelDims.from_world(1024, tp=8, pp=16, ep=64),
        ...                     TrainSpec(global_batch_size=1024, microbatches=64), ClusterSpec(128, 8, H200))
        >>> 0.0 < est.mfu < 0.6
        True
    """
    if cluster.world_size != dims.world_size:
        raise ValueError(f"the layout has {dims.world_size} ranks but the cluster {cluster.world_size}.")
    layout = layout if layout is not None else stage_layout(spec, dims, train.schedule)
    native = train.data_parallel in ("fsdp", "replicate")
    if records is None:
        base = train if native else train.with_(data_parallel="fsdp" if train.data_parallel == "hsdp"
                                                else "replicate")
        records = comm_per_rank(spec, dims, base, layout)
    crossing = crossing if crossing is not None else axes_crossing_nodes(dims, cluster)
    m = resolve_microbatches(dims, train)
    b = micro_batch_size(dims, train)
    schedule = train.schedule if dims.pp > 1 else "1f1b"
    bubble = (replayed_bubble if replay else bubble_theory)(schedule, dims.pp, m, dims.virtual_stages)
    peak = cluster.device.peak_flops
    v_last = stage_to_rank(dims.num_stages - 1, dims.pp, stage_style(train.schedule, dims.pp))  # holds the head
    best = None
    work = []  # per pp rank: seconds of its own (compute + optimizer) and of its critical communication
    for r, layers in enumerate(layout):
        flops = rank_flops(spec, dims, train, layers, r == v_last)
        ct = rank_compute_time(spec, dims, train, cluster.device, layers, r == v_last, b, m)
        compute = ct.total
        comm = comm_seconds(records[r], dims, cluster, crossing)
        if not native:
            comm.update(_dp_mode_seconds(spec, dims, train, cluster, layers, r == 0, r == v_last, m))
        busy = compute + sum(comm[a] for a in _CRITICAL)
        dp_exposed = max(0.0, comm["dp"] + comm["edp"] - compute)
        optim = optimizer_seconds(_held_params(spec, dims, train, layers, r == 0, r == v_last), cluster.device)
        optim += cluster.device.step_overhead  # the host's own per-step work (CPU; 0 on GPUs)
        step = busy / (1.0 - bubble) + dp_exposed + optim
        work.append((compute + optim + sum(comm.values()), 0.0))
        if best is None or step > best[0]:
            best = (step, r, flops, compute, comm, dp_exposed, busy, optim, ct)
    step, r, flops, compute, comm, dp_exposed, busy, optim, ct = best
    shared = shared_cores_step(work, dims, cluster)
    tokens = train.global_batch_size * train.seq(spec)
    model_flops = float(spec.flops_per_token(train.seq(spec)) * tokens)
    parts = {"compute": compute, **{f"comm_{a}": comm[a] for a in _CRITICAL},
             "bubble": busy * bubble / (1.0 - bubble), "dp_exposed": dp_exposed, "optimizer": optim}
    if shared > step:
        parts["shared_cores"] = shared - step
        step = shared
    return StepEstimate(model_flops, flops, compute, comm, bubble, dp_exposed, step,
                        model_flops / (dims.world_size * peak * step), tokens / step, crossing, parts, r,
                        {"gemm": ct.gemm, "attention": ct.attention, "memory_bound": ct.memory,
                         "recompute": ct.recompute, "host": ct.host})


def shared_cores_step(work: list[tuple[float, float]], dims: ParallelDims, cluster: ClusterSpec) -> float:
    """Step seconds when the ranks of a node take turns on fewer cores than ranks (CPU runs): each node's
    ranks' own work over its cores, plus the busiest rank's time that no other rank can use
    (``work[pp_rank] = (own, exposed)``); 0 when every rank has its own device.

    :func:`estimate_step` counts as a rank's own work its compute, optimizer step and communication (gloo moves
    the bytes with the CPU, and a call's latency is its CPU cost), and nothing as exposed: while one rank waits
    for a peer or sits in the bubble, the others use the cores.

    Example:
        >>> from lightning_4d.planner.hardware import CPU
        >>> shared_cores_step([(1.0, 0.1), (1.0, 0.2)], ParallelDims.from_world(8, tp=2, pp=2),
        ...                   ClusterSpec(1, 8, CPU.with_(cores=2)))
        4.2
    """
    cores = cluster.device.cores
    g = cluster.gpus_per_node
    if cores is None or cores >= g:
        return 0.0
    per_role = dims.dp * dims.cp * dims.tp  # ranks of one pipeline rank
    out = 0.0
    for node in range(-(-dims.world_size // g)):
        ranks = range(node * g, min((node + 1) * g, dims.world_size))
        own = sum(work[rank // per_role][0] for rank in ranks)
        out = max(out, own / cores + max(work[rank // per_role][1] for rank in ranks))
    return out


def _held_params(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec, layers: list[int], first: bool,
                 last: bool) -> float:
    """Parameters whose optimizer state one rank updates (its shard)."""
    from lightning_4d.planner.memory import local_params

    lp = local_params(spec, dims, layers, first, last)
    if train.data_parallel == "replicate":
        return float(lp["dense"] + lp["experts"])
    return lp["dense"] / dims.dp_cp + lp["experts"] / dims.edp
