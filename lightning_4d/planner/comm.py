"""Communication per training step: bytes each rank sends, per collective kind and mesh axis.

Bytes a rank sends for one collective over ``n`` ranks on a tensor of ``S`` bytes (the full
tensor; ring / pairwise algorithms): all-reduce ``2(n − 1)/n·S``; all-gather, reduce-scatter and
all-to-all ``(n − 1)/n·S``; a pipeline send ``S``.

What is counted per step (``m`` micro-batches of ``b`` sequences of length ``s``, hidden ``h``,
compute bytes ``c`` = 2 for bf16, activation ``A = b·s·h·c``):

- **tp** (per micro-batch; Megatron, Korthikanti et al. 2022): a dense layer does 2 all-reduces of
  ``A`` forward and 2 backward (after the row-parallel attention output and MLP output, and for the
  gradients of the column-parallel inputs); with SP each becomes an all-gather + a reduce-scatter of
  ``A`` — the same bytes in twice the calls. An MoE layer (experts folded into the dp×tp ranks, tokens
  routed from the rank's own sequence shard) keeps only the attention's half. The vocab-parallel
  embedding adds an all-reduce forward, the column-parallel head an all-reduce backward. SP splits the
  sequence between the blocks only (code around them sees the full sequence): the first block's input
  split costs an all-gather backward, the last block's output an all-gather forward;
  loss parallel 3 all-reduces of ``b·s`` fp32 numbers (max, sum of exponentials, target logit).
  With SP only (without it tp-replicated parameters see replicated activations and need nothing): the
  norms' gradients, one DTensor all-reduce per tensor and micro-batch inside a data-parallel wrapper
  (dp > 1; without one, dp = 1, they stay Partial until the strategy resolves them once per step); the
  router's and shared experts' fp32 gradients, summed over tp once per step by the strategy on the
  rank's FSDP shard. Activation checkpointing runs each block's forward again in backward, with its
  collectives, up to the last one whose output backward needs (torch's early stop): a dense block's MLP
  output reduction is not repeated; ``selective`` saves the region outputs' reduce-scatters / all-reduces
  (:mod:`lightning_4d.layout.activation_checkpoint`), so only the all-gathers run again.
- **pp** (per micro-batch): each stage boundary to another rank carries one activation ``A`` forward
  (``A / t`` with SP: a rank sends its sequence shard) and its gradient backward; with tied embeddings on two
  ranks, the first and last stage exchange the table's local gradient shard once per step.
- **ep** (per MoE layer and micro-batch): dispatch and combine all-to-alls forward, their reverses
  backward, each of ``S = N·k·h·c·ι`` with ``N = b·s/t`` tokens (SP) routed to ``k`` experts,
  **assuming uniform routing** (each rank sends ``(n − 1)/n`` of its assignments away) times the
  imbalance factor ``ι`` (``TrainSpec.expert_imbalance``); plus one all-to-all of ``E`` int64 counts
  (forward; again when recomputed). With a router aux loss (``TransformerSpec.router_aux_loss``) one
  all-reduce of ``2E + 1`` fp64 statistics per MoE forward over ep and edp (dp without SP).
- **loss** (:func:`_loss_statistics`): the global-batch loss's few scalars over the ``dp × cp`` ranks (and its
  broadcast from the last pipeline stage over pp).
- **dp / edp** (dense parameters over dp, routed experts over edp): FSDP2 all-gathers the
  compute-dtype parameters and reduce-scatters fp32 gradients once per step; ``replicate``
  all-reduces fp32 gradients once. Units as ``lightning_4d.layout.data_parallel`` wraps them: each block
  (without pipelining all but the last reshard after forward, under pipelining none does), each MoE
  layer's experts (over edp; resharding as the blocks do, :func:`lightning_4d.layout.data_parallel.reshards_after_forward`,
  unless ``TrainSpec.expert_reshard_after_forward`` says otherwise) and the root
  (embedding, final norm, head; not resharding). FSDP2 shards dim 0, so ``E/ep`` local experts over
  more ``edp`` ranks are padded (:func:`expert_padding`). All-gathers per unit: without pipelining a
  resharding unit gathers twice per micro-step (forward, backward), the others once; with pipelining
  torch keeps parameters gathered after each backward until the last, so a non-resharding unit
  gathers once per step and a resharding one (every forward frees it) once per micro-batch backward
  plus once per warm-up forward (``m + in_flight``, at most ``2m``; GPipe ``m + 1``).
  ``TrainSpec.reshard_after_forward=False`` makes every unit non-resharding.

Example:
    >>> collective_bytes("all_reduce", 4, 100.0), collective_bytes("all_gather", 4, 100.0)
    (150.0, 75.0)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Optional

from lightning_4d.core.comm import wire_bytes
from lightning_4d.config import stage_style
from lightning_4d.context_parallel.cost import kv_gathered_bytes
from lightning_4d.layout.data_parallel import reshards_after_forward
from lightning_4d.mesh import ParallelDims
from lightning_4d.planner.memory import local_params, micro_batch_size, resolve_microbatches, stage_layout
from lightning_4d.planner.spec import TrainSpec, TransformerSpec

__all__ = ["KINDS", "Collective", "block_tensor_shapes", "collective_bytes", "comm_per_rank", "expert_padding",
           "fsdp_elements", "root_tensor_shapes", "summarize",
           "ROUTING_ASSUMPTION"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "broadcast")
ROUTING_ASSUMPTION = "uniform routing: every rank sends (ep-1)/ep of its k·N token copies away, times the imbalance"


def collective_bytes(kind: str, n: int, size: float) -> float:
    """Bytes one rank sends in a collective over ``n`` ranks on a full tensor of ``size`` bytes (the one
    formula, :func:`lightning_4d.core.comm.wire_bytes`, for the planner's kinds).

    Example:
        >>> collective_bytes("all_to_all", 8, 800.0), collective_bytes("send", 2, 10.0)
        (700.0, 10.0)
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}.")
    return wire_bytes(kind, size, n)


@dataclass(frozen=True)
class Collective:
    """``calls`` collectives of one kind over one axis in a step; ``size`` is ``S`` of one call and
    ``bytes_sent`` what the rank sends for all of them."""

    axis: str
    kind: str
    what: str
    calls: int
    size: float
    group: int

    @property
    def bytes_sent(self) -> float:
        """``calls · collective_bytes(kind, group, size)``."""
        return self.calls * collective_bytes(self.kind, self.group, self.size)

    def as_dict(self) -> dict:
        """Plain dict (with ``bytes_sent``)."""
        return {**asdict(self), "bytes_sent": self.bytes_sent}


def _sharded_rows(rows: int, cols: int, n: int) -> int:
    """Elements of one rank's FSDP2 shard of a ``rows × cols`` tensor over ``n`` ranks (dim-0 chunks of
    ``ceil(rows / n)`` rows, the rank holding a full chunk)."""
    return -(-rows // n) * cols


def block_tensor_shapes(spec: TransformerSpec, tp: int, moe: bool) -> list[tuple[int, int]]:
    """``(rows, cols)`` of each dense parameter tensor of one block as a rank holds it under ``tp`` (dim 0 is
    what FSDP2 shards): column-parallel weights and biases split their rows, row-parallel weights their
    columns, norms, row-parallel biases, router and shared experts whole. Routed experts are not listed.

    Example:
        >>> spec = TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, ffn_hidden=4)
        >>> sum(r * c for r, c in block_tensor_shapes(spec, 1, False)) == spec.layer_params(0)["attention"] + 56
        True
    """
    h, a, g, d, t = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, tp
    q, kv = a * d // t, g * d // t
    qkv = [(q + 2 * kv, h)] if spec.fused_qkv else [(q, h), (kv, h), (kv, h)]
    out = qkv + [(h, a * d // t)]
    if spec.qkv_bias:
        out += [(q + 2 * kv, 1)] if spec.fused_qkv else [(q, 1), (kv, 1), (kv, 1)]
    out += [(h, 1)] if spec.out_bias else []
    out += [(h, 1)] * (4 if spec.norm == "layernorm" and spec.norm_bias else 2)  # two norms
    out += [(d, 1)] * 2 if spec.qk_norm else []  # q and k norms (Qwen3)
    up = 2 if spec.gated_mlp else 1
    if moe and spec.num_experts:
        out.append((spec.num_experts, h))  # router
        fs = spec.shared_experts * spec.expert_hidden
        out += [(fs, h)] * up + [(h, fs)] if fs else []
    else:
        f = spec.ffn_hidden // t
        out += [(f, h)] * up + [(h, f)]
        out += [(f, 1)] * up + [(h, 1)] if spec.mlp_bias else []
    return out


def root_tensor_shapes(spec: TransformerSpec, tp: int, first: bool, last: bool) -> list[tuple[int, int]]:
    """``(rows, cols)`` of the root's tensors on a rank holding the first and/or last stage: the
    vocabulary-parallel token table, learned positions, final norm, head (unless tied and also here).

    Example:
        >>> root_tensor_shapes(TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1), 2, True, True)
        [(4, 4), (4, 1), (4, 4)]
    """
    h, out = spec.hidden, []
    table = (-(-spec.vocab_size // tp), h)
    if first:
        out.append(table)
        out += [(spec.learned_positions, h)] if spec.learned_positions else []
    if last:
        out += [(h, 1)] * (2 if spec.norm == "layernorm" and spec.norm_bias else 1)
        out += [table] if (not spec.tied_embeddings or not first) else []
    return out


def fsdp_elements(shapes: list[tuple[int, int]], n: int) -> int:
    """Elements FSDP2 gathers / reduce-scatters for these tensors over ``n`` ranks: each is sharded on dim 0
    in chunks of ``ceil(rows / n)`` rows, so a dimension ``n`` does not divide is padded.

    Example:
        >>> fsdp_elements([(10, 3)], 4), fsdp_elements([(8, 3)], 4)
        (36, 24)
    """
    return sum(-(-r // n) * n * c for r, c in shapes)


def _tp(spec: TransformerSpec, dims: ParallelDims, layers: list[int], first: bool, last: bool, m: int,
        act: float, bs: int, c: int, recompute: bool = False, dp_shards: int = 1,
        recompute_outputs: bool = False) -> list[Collective]:
    t = dims.tp
    if t == 1:
        return []
    dense = sum(1 for i in layers if not spec.is_moe_layer(i))
    moe = len(layers) - dense
    # A recomputed forward (activation checkpointing) repeats the blocks' forward collectives, except the
    # last one of a dense block (its MLP output feeds only the residual sum, so torch's checkpoint stops
    # recomputing before it) and, under "selective", the region outputs (their results are saved).
    redo_in = m * (2 * dense + moe) if recompute else 0  # SP all-gathers (region inputs)
    redo_out = m * (dense + moe) if recompute_outputs else 0  # SP reduce-scatters / all-reduces (region outputs)
    out = []
    if dims.sp:
        pairs = m * (4 * dense + 2 * moe)  # all-gather + reduce-scatter pairs, forward + backward
        out += [Collective("tp", "all_gather", "SP layer inputs (fwd) / grads (bwd)", pairs + redo_in, act, t),
                Collective("tp", "reduce_scatter", "SP layer outputs (fwd) / grads (bwd)", pairs + redo_out, act, t)]
        if first:
            # The sequence is split between the blocks only: the vocab-parallel embedding's output is all-reduced
            # (code before the blocks sees the full sequence), the first block keeps its shard (its backward: an
            # all-gather).
            out += [Collective("tp", "all_reduce", "vocab-parallel embedding fwd", m, act, t),
                    Collective("tp", "all_gather", "first block input split bwd", m, act, t)]
        if last:
            # The last block's output is gathered; the head's replicated input gets its gradient all-reduced.
            out += [Collective("tp", "all_gather", "last block output fwd", m, act, t),
                    Collective("tp", "all_reduce", "head input grad bwd", m, act, t)]
    else:
        out.append(Collective("tp", "all_reduce", "row-parallel outputs (fwd), column-parallel input grads (bwd)",
                              m * (4 * dense + 2 * moe) + redo_out, act, t))
        if first:
            out.append(Collective("tp", "all_reduce", "vocab-parallel embedding fwd", m, act, t))
        if last:
            out.append(Collective("tp", "all_reduce", "head input grad bwd", m, act, t))
    if last:
        out.append(Collective("tp", "all_reduce", "loss parallel (max, sum exp, target logit)", 3 * m, bs * 4.0, t))
    if not dims.sp:  # tp-replicated parameters see identical (replicated) activations: nothing to reduce
        return out
    # Sequence-parallel norms (DTensor Replicate parameters fed by sequence shards): their gradients are Partial
    # DTensors. Inside a data-parallel wrapper (dp > 1) it reduces each one in the backward of every micro-batch
    # (compute dtype); without one (dp = 1) they stay Partial until the strategy resolves them once per step,
    # after backward (fp32 parameters). (Row-parallel biases are added before the reduce-scatter, to the full
    # sequence: their gradients need nothing.)
    per_norm = 2 if spec.norm == "layernorm" and spec.norm_bias else 1
    norms = 2 * len(layers)  # the final norm runs on the full (gathered) sequence: replicated
    if norms and dims.dp_cp > 1:
        out.append(Collective("tp", "all_reduce", "grads of SP norms (per micro-batch)", m * norms * per_norm,
                              spec.norm_params * c / per_norm, t))
    elif norms:
        out.append(Collective("tp", "all_reduce", "grads of SP norms (Partial, resolved once per step)",
                              norms * per_norm, spec.norm_params * 4.0 / per_norm, t))
    # Router and shared experts (plain parameters fed by sequence shards): the strategy sums their fp32
    # gradients over tp once per step, after backward, on the rank's FSDP shard, in one coalesced all-reduce.
    calls = elems = 0
    h = spec.hidden
    for i in layers:
        if not spec.is_moe_layer(i):
            continue
        calls, elems = calls + 1, elems + _sharded_rows(spec.num_experts, h, dp_shards)
        if spec.shared_experts:
            fs = spec.shared_experts * spec.expert_hidden
            calls += 3
            elems += 2 * _sharded_rows(fs, h, dp_shards) + _sharded_rows(h, fs, dp_shards)
    if calls:  # coalesced: one all-reduce of all of them (fp32, one dtype)
        out.append(Collective("tp", "all_reduce", "grads of router / shared experts (once per step, coalesced)", 1,
                              elems * 4.0, t))
    return out


def _gather_passes(dims: ParallelDims, train: TrainSpec, m: int, pp_rank: int, reshards: bool) -> int:
    """How many times FSDP all-gathers one unit in a step (module docstring); ``reshards``: the unit is
    wrapped with ``reshard_after_forward=True``."""
    from lightning_4d.planner.bubble import in_flight_microbatches

    if dims.pp == 1:
        return 2 * m if reshards else m
    if not reshards:
        return 1
    if train.schedule == "gpipe":
        return m + 1
    warm = in_flight_microbatches(train.schedule, dims.pp, m, pp_rank, dims.virtual_stages)
    return int(min(2 * m, m + round(warm)))


def _data_parallel(dims: ParallelDims, train: TrainSpec, m: int, r: int, lp: dict, c: int,
                   expert_padding: float = 1.0) -> list[Collective]:
    """FSDP2 / replicate collectives of one rank, unit by unit as ``lightning_4d.layout.parallelize`` wraps them:
    each block over dp (without pipelining all but the last reshard after forward; under pipelining none
    does), each MoE layer's experts over edp (as the blocks, unless ``train`` says otherwise), the root
    (embedding, final norm, head) over dp without resharding. ``expert_padding`` multiplies the expert
    units' bytes (FSDP2 pads dim 0, the ``E/ep`` local experts, to a multiple of ``edp``)."""
    raf = train.reshard_after_forward if train.reshard_after_forward is not None else reshards_after_forward(dims.pp)
    raf_experts = train.expert_reshard_after_forward if train.expert_reshard_after_forward is not None else raf
    mode = train.data_parallel
    hsdp = mode == "hsdp"
    shard = _dp_shard(dims, train) if hsdp else dims.dp
    dense_axis = "dp_shard" if hsdp else "dp_cp" if dims.cp > 1 else "dp"  # cp: dense params over dp × cp
    n = len(lp["layer_dense"])
    units = [(dense_axis, "root", lp["root"], False)]
    units += [(dense_axis, "block", d, raf and i < n - 1) for i, d in enumerate(lp["layer_dense"])]
    pad = expert_padding if mode in ("fsdp", "hsdp") else 1.0
    units += [("edp", "experts", e * pad, raf_experts) for e in lp["layer_experts"] if e]
    groups = {"dp": dims.dp, "dp_cp": dims.dp_cp, "edp": dims.edp, "dp_shard": shard, "dp_replicate": dims.dp // shard}
    acc: dict[tuple, list] = {}

    def add(axis: str, kind: str, label: str, calls: int, size: float) -> None:
        a = acc.setdefault((axis, kind, label), [0, 0.0])
        a[0], a[1] = a[0] + calls, a[1] + calls * size

    for axis, what, params, reshards in units:
        if params == 0:
            continue
        if mode in ("fsdp", "hsdp"):  # experts are FSDP2 over edp under HSDP too
            if groups[axis] > 1:
                p = _gather_passes(dims, train, m, r, reshards)
                add(axis, "all_gather", f"FSDP {what} params", p, params * c)
                add(axis, "reduce_scatter", f"FSDP {what} grads (fp32)", 1, params * 4.0)
            if hsdp and axis == "dp_shard" and groups["dp_replicate"] > 1:  # the shard's gradient across replicas
                add("dp_replicate", "all_reduce", f"HSDP {what} grad shards (fp32)", 1, params * 4.0 / groups[axis])
        elif groups[axis] > 1:
            add(axis, "all_reduce", f"replicate {what} grads (fp32)", 1, params * 4.0)
    return [Collective(axis, kind, label, calls, total / calls, groups[axis])
            for (axis, kind, label), (calls, total) in acc.items()]


def _dp_shard(dims: ParallelDims, train: TrainSpec) -> int:
    """HSDP's shard group size: the train spec's, else the layout's, else the whole dp (plain FSDP)."""
    return train.dp_shard or dims.dp_shard or dims.dp


def expert_padding(spec: TransformerSpec, dims: ParallelDims) -> float:
    """Factor FSDP2's dim-0 padding puts on the expert units: the ``E/ep`` local experts of each weight are
    sharded over ``edp`` ranks in chunks of ``ceil(E/ep / edp)``, so fewer local experts than ``edp``
    ranks are padded to ``edp`` rows (e.g. the 1T MoE's 8 local experts over edp = 16: factor 2).

    Example:
        >>> from lightning_4d.planner.spec import seed_moe_1t
        >>> expert_padding(seed_moe_1t(), ParallelDims.from_world(512, tp=8, pp=4, ep=8))
        2.0
    """
    if not spec.num_experts or dims.edp == 1:
        return 1.0
    local = spec.num_experts // dims.ep
    return -(-local // dims.edp) * dims.edp / local


def comm_per_rank(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec,
                  layout: Optional[list[list[int]]] = None) -> list[list[Collective]]:
    """Collectives of one step for each pipeline rank (see the module docstring).

    Example:
        >>> spec = TransformerSpec(vocab_size=64, hidden=32, layers=2, heads=4, seq_len=16)
        >>> recs = comm_per_rank(spec, ParallelDims(2, tp=2, sequence_parallel=False), TrainSpec(global_batch_size=2))
        >>> [(r.kind, r.calls) for r in recs[0] if r.what.startswith("row")]
        [('all_reduce', 8)]
    """
    m = resolve_microbatches(dims, train)
    b = micro_batch_size(dims, train)
    layout = layout if layout is not None else stage_layout(spec, dims, train.schedule)
    s, h, c, t = train.seq(spec) // dims.cp, spec.hidden, train.act_bytes, dims.tp  # this rank's tokens
    act = float(b * s * h * c)
    style = stage_style(train.schedule, dims.pp)
    num_stages = dims.num_stages
    # Checkpointed blocks run their forward again in backward; its collectives with it (the package's
    # "selective" policy also saves the outputs of tp's reduce-scatters / all-reduces: those are not repeated;
    # the expert and cp collectives, not functional ones, are).
    recompute = train.activation_checkpointing in ("full", "selective")
    padding = expert_padding(spec, dims)
    from lightning_4d.pipeline.partition import stage_ids_for_rank, stage_to_rank

    out = []
    for r, layers in enumerate(layout):
        first, last = r == 0, r == stage_to_rank(num_stages - 1, dims.pp, style)
        fsdp_ranks = {"fsdp": dims.dp_cp, "hsdp": _dp_shard(dims, train)}.get(train.data_parallel, 1)
        recs = _tp(spec, dims, layers, first, last, m, act, b * s, c, recompute, fsdp_ranks,
                   recompute_outputs=train.activation_checkpointing == "full")
        if dims.pp > 1:
            stages = stage_ids_for_rank(r, dims.pp, dims.virtual_stages, style)
            fwd = sum(1 for st in stages if st < num_stages - 1 and stage_to_rank(st + 1, dims.pp, style) != r)
            bwd = sum(1 for st in stages if st > 0 and stage_to_rank(st - 1, dims.pp, style) != r)
            shard = act / t if dims.sp else act
            if fwd:
                recs.append(Collective("pp", "send", "activations to the next stage", m * fwd, shard, 2))
            if bwd:
                recs.append(Collective("pp", "send", "activation grads to the previous stage", m * bwd, shard, 2))
        n_moe = sum(1 for i in layers if spec.is_moe_layer(i))
        fwd_passes = 2 if recompute else 1  # forwards of each MoE layer per micro-batch
        if dims.ep > 1 and n_moe:
            tokens = b * s / (t if dims.sp else 1)
            payload = tokens * spec.top_k * h * c * train.expert_imbalance
            recs += [Collective("ep", "all_to_all", "dispatch + combine (fwd) and their reverses (bwd)",
                                (2 + 2 * fwd_passes) * m * n_moe, payload, dims.ep),
                     Collective("ep", "all_to_all", "token counts per expert", fwd_passes * m * n_moe,
                                8.0 * spec.num_experts, dims.ep)]
        if spec.router_aux_loss and n_moe:
            # Router statistics (counts, probability sums, token count: 2E + 1 fp64) for the aux loss, over the
            # groups holding one batch's tokens (lightning_4d.layout.parallelize: ep and edp, or dp without SP).
            stats = [("ep", dims.ep), ("edp", dims.edp)] if (dims.sp or t == 1) else [("dp", dims.dp_cp)]
            recs += [Collective(axis, "all_reduce", "router statistics (aux loss)", fwd_passes * m * n_moe,
                                8.0 * (2 * spec.num_experts + 1), n) for axis, n in stats if n > 1]
        algorithm = train.cp_algorithm_for(spec, dims.cp, t)
        if algorithm == "allgather":  # K/V of every attention layer: all-gathered in forward (again when
            # recomputed), their gradients reduce-scattered in backward
            full = kv_gathered_bytes(b, train.seq(spec), spec.gathered_kv_width, c, t)
            recs += [Collective("cp", "all_gather", "K/V along the sequence (fwd)", fwd_passes * m * len(layers), full,
                                dims.cp),
                     Collective("cp", "reduce_scatter", "K/V grads along the sequence (bwd)", m * len(layers), full,
                                dims.cp)]
        elif algorithm == "ulysses":  # q|k|v heads <-> sequence and the output back, forward (again when
            # recomputed) and backward: all-to-alls of this rank's b·(T/cp)·w/tp elements (K/V as wide as q)
            local = b * train.seq(spec) / dims.cp * spec.q_width / t * c
            passes = (fwd_passes + 1) * m * len(layers)
            recs += [Collective("cp", "all_to_all", "q, k, v heads <-> sequence (fwd, bwd)", passes, 3 * local, dims.cp),
                     Collective("cp", "all_to_all", "attention output back (fwd, bwd)", passes, local, dims.cp)]
        recs += _loss_statistics(dims, m)
        last_rank = stage_to_rank(num_stages - 1, dims.pp, style)
        if spec.tied_embeddings and (first or last) and last_rank != 0:
            # The token table's two copies (first and last stage): their gradients' local shards are exchanged
            # once per step (lightning_4d.pipeline.tied), each rank sending its own.
            rows = -(-spec.vocab_size // t)
            recs.append(Collective("pp", "send", "tied embedding grads (fp32, once per step)", 1,
                                   _sharded_rows(rows, h, fsdp_ranks) * 4.0, 2))
        lp = local_params(spec, dims, layers, first, last)
        if fsdp_ranks > 1:  # FSDP2 pads dim 0 of each tensor to a multiple of its shard group
            lp = dict(lp, root=fsdp_elements(root_tensor_shapes(spec, t, first, last), fsdp_ranks),
                      layer_dense=[fsdp_elements(block_tensor_shapes(spec, t, spec.is_moe_layer(i)), fsdp_ranks)
                                   for i in layers])
        recs += _data_parallel(dims, train, m, r, lp, c, padding)
        out.append(recs)
    return out


def _loss_statistics(dims: ParallelDims, m: int) -> list[Collective]:
    """The global-batch loss's scalars (:mod:`lightning_4d.core.loss`, :func:`lightning_4d.layout.pipeline_glue.pipeline_train_loss`)
    over the ``dp × cp`` ranks holding different tokens: without pipelining one all-reduce of ``(Σ n·L, Σ n)`` (2 fp64)
    per micro-step; with it the token total and the loss (1 fp64 each) once per step, and the last stage's loss
    broadcast over pp (1 fp32).

    Example:
        >>> [(c.axis, c.kind, c.size) for c in _loss_statistics(ParallelDims.from_world(4, pp=2), 2)]
        [('dp', 'all_reduce', 8.0), ('dp', 'all_reduce', 8.0), ('pp', 'broadcast', 4.0)]
    """
    axis = "dp_cp" if dims.cp > 1 else "dp"
    out = []
    if dims.pp == 1:
        if dims.dp_cp > 1:
            out.append(Collective(axis, "all_reduce", "global loss: Σ n·L and Σ n (fp64)", m, 16.0, dims.dp_cp))
        return out
    if dims.dp_cp > 1:
        out += [Collective(axis, "all_reduce", "token total (fp64)", 1, 8.0, dims.dp_cp),
                Collective(axis, "all_reduce", "global loss (fp64)", 1, 8.0, dims.dp_cp)]
    return out + [Collective("pp", "broadcast", "loss from the last stage (fp32)", 1, 4.0, dims.pp)]


def summarize(records: list[Collective]) -> dict[str, dict[str, float]]:
    """Bytes sent per axis and kind, ``{axis: {kind: bytes}}`` (only non-zero entries).

    Example:
        >>> summarize([Collective("tp", "all_reduce", "x", 2, 100.0, 2)])
        {'tp': {'all_reduce': 200.0}}
    """
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for rec in records:
        if rec.bytes_sent:
            out[rec.axis][rec.kind] = out[rec.axis].get(rec.kind, 0.0) + rec.bytes_sent
    return dict(out)
