"""Memory per rank: model states, FSDP buffers, activations — for every pipeline rank of a layout.

Ranks of one pipeline stage differ only by their tp / dp / ep coordinates, which hold equal shares,
so one :class:`RankMemory` per pp rank describes every rank (``role = pp rank``).

**Model states** (bytes per parameter, AdamW, as FSDP2 with the package's mixed precision keeps them):
fp32 parameters (the master copy) 4, fp32 gradients 4, two fp32 moments
``TrainSpec.optimizer_state_bytes`` = 8. Shares held by a rank: dense matmul weights and vocab tables
``/ tp`` (norms, router, shared experts, row-parallel biases and position tables are replicated over
tp), only the layers of its pipeline stages (the embedding on the first stage, final norm and head on
the last, a tied table on both), routed experts ``/ ep``; then FSDP divides dense states by ``dp`` and
expert states by ``edp``; ``replicate`` keeps them whole.

**Unsharded buffers** (compute dtype ``c`` = 2 for bf16-mixed, 4 for fp32):
FSDP gathers one layer at a time with one prefetched (``2·c·layer``) and keeps the root (embedding,
norm, head) gathered (``c·root``); without pipelining or accumulation it holds one layer's unsharded
fp32 gradient (``4·layer``). With ``pp > 1`` torch's pipeline stages turn off resharding after
backward and gradient reduction until the last micro-batch, and with gradient accumulation the
package turns off gradient sync: the rank then holds unsharded fp32 gradient accumulators for all
its parameters (4 each) and, with ``pp > 1`` or ``reshard_after_forward=False``, all its parameters
gathered (``c`` each, the peak right after a backward). ``replicate`` casts two layers
(``2·c·layer``, bf16 only). Parameters outside any data-parallel wrapper (dense ones when ``dp = 1``,
experts when ``edp = 1``, as ``lightning_4d.layout.parallelize`` leaves them) have no gathered copies.

**Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4): per layer and micro-batch, in bytes with 16-bit activations and 1-byte dropout masks,

    A_layer = s·b·h · (R + (T_attn + T_mlp + 5·a·s/h) / t)          sequence parallel (SP)
    A_layer = s·b·h · (R + (T_attn + T_mlp) / t + 5·a·s/(h·t))      TP without SP

with ``R = 10`` (two norm inputs 4, the QKV and MLP inputs 2 + 2, two dropout masks 2) — the part
SP divides by ``t`` — ``T_attn = 4 + 4·g/a`` (Q, K, V, output-projection input; 8 without GQA),
``T_mlp = 4·F/h`` for a GeLU MLP (16 for ``F = 4h``: the paper's ``34 + 5as/h`` total) or ``6·F/h``
for SwiGLU (``w1``, ``w3`` outputs and the ``w2`` input). Those are the counts of fused kernels
(``TrainSpec.kernels="fused"``: Megatron, Transformer Engine). PyTorch's eager kernels (``"eager"``, the runtime's,
measured on the package's Llama) keep more: keys and values repeated to every query head before attention and the
attention output twice (the kernel's and the output projection's contiguous input), ``T_attn = 10`` (q = h), and
``silu(w1 x)`` besides ``w1 x``, ``w3 x`` and their product, ``T_mlp = 8·F/h`` (``6·F/h`` again under
``torch.compile``, which fuses the product). An MoE layer's ``T_mlp`` is
``k·ι·(2 + 6·Fe/h) + 6·Fs/h + 4·E/h`` (the permuted copies of the ``k`` assignments per token and
their expert activations, ``ι`` the imbalance factor, the shared experts, fp32 router scores); it is
divided by ``t`` only with SP (without SP every tp rank routes the same tokens). ``5·a·s/h`` (the
``s×s`` scores, softmax and dropout) vanishes with flash attention or selective recomputation; full
recomputation stores only ``2·s·b·h`` per layer (``/ t`` with SP) plus one layer's working set.
fp32 activations double everything. Context parallelism (``cp > 1``) holds ``s/cp`` tokens of all this, plus per
layer, under the K/V all-gather only, the gathered K/V beyond its share (the algorithm the runtime runs:
:meth:`~lightning_4d.planner.spec.TrainSpec.cp_algorithm_for`; :mod:`lightning_4d.context_parallel.cost`; measured by
``bench/bench_context_parallel.py``). A rank holds
``in_flight`` micro-batches (:func:`~lightning_4d.planner.bubble.in_flight_microbatches`) of its layers'
activations; the last
stage also holds one micro-batch of logits ``s·b·V/t·(c + 4)`` (bf16 logits and fp32 softmax).

Example:
    >>> from lightning_4d.planner.spec import TransformerSpec, TrainSpec
    >>> from lightning_4d.mesh import ParallelDims
    >>> spec = TransformerSpec(vocab_size=64, hidden=32, layers=4, heads=4, seq_len=16)
    >>> mem = memory_per_rank(spec, ParallelDims.from_world(4, tp=2, pp=2), TrainSpec(global_batch_size=4))
    >>> [m.layers for m in mem], mem[0].in_flight
    ([[0, 1], [2, 3]], 2)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Optional

from lightning_4d.context_parallel.cost import kv_gathered_bytes
from lightning_4d.layout.data_parallel import wrap_mode
from lightning_4d.mesh import ParallelDims
from lightning_4d.pipeline.partition import stage_to_rank
from lightning_4d.pipeline.schedules import in_flight_microbatches, stage_style
from lightning_4d.planner.setup_memory import setup_peak_bytes
from lightning_4d.planner.spec import TrainSpec, TransformerSpec
from lightning_4d.core.precision import precision_info

__all__ = ["RankMemory", "check_layout", "activation_coefficients", "layer_activation_bytes", "memory_per_rank",
           "micro_batch_size",
           "resolve_microbatches", "stage_layout", "local_params", "saved_activation_bytes", "logits_bytes"]


def check_layout(spec: TransformerSpec, dims: ParallelDims) -> None:
    """Raise ``ValueError`` when the model cannot be cut this way (heads / experts / layers per degree).

    Example:
        >>> check_layout(TransformerSpec(vocab_size=8, hidden=8, layers=2, heads=2), ParallelDims(4, tp=4))
        Traceback (most recent call last):
        ...
        ValueError: tp=4 does not divide heads=2 and kv_heads=2: tensor parallelism splits whole heads.
    """
    if spec.heads % dims.tp or spec.kv_heads % dims.tp:
        raise ValueError(f"tp={dims.tp} does not divide heads={spec.heads} and kv_heads={spec.kv_heads}: tensor "
                         f"parallelism splits whole heads.")
    if dims.ep > 1 and (not spec.is_moe or spec.num_experts % dims.ep):
        raise ValueError(f"ep={dims.ep} needs an MoE model whose num_experts={spec.num_experts} it divides.")
    if dims.num_stages > spec.layers:
        raise ValueError(f"pp·v = {dims.num_stages} stages exceed the {spec.layers} layers.")


def resolve_microbatches(dims: ParallelDims, train: TrainSpec) -> int:
    """Micro-batches per step: ``train.microbatches`` or the schedule default ``pp·v`` (1 without pp)."""
    if train.microbatches is not None:
        return train.microbatches
    return dims.pp * dims.virtual_stages if dims.pp > 1 else 1


def micro_batch_size(dims: ParallelDims, train: TrainSpec) -> int:
    """Sequences per micro-batch ``b = global_batch / (dp · m)``; raises if it does not divide.

    Example:
        >>> micro_batch_size(ParallelDims.from_world(4, pp=2), TrainSpec(global_batch_size=8))
        2
    """
    m = resolve_microbatches(dims, train)
    if train.global_batch_size % (dims.dp * m):
        raise ValueError(f"global_batch_size={train.global_batch_size} does not split into dp·m = {dims.dp}·{m} "
                         f"equal micro-batches; use a multiple of {dims.dp * m}.")
    return train.global_batch_size // (dims.dp * m)


def stage_layout(spec: TransformerSpec, dims: ParallelDims, schedule: str) -> list[list[int]]:
    """Layer ids held by each pp rank (its stages' blocks, in order), via the package's partitioner.

    Example:
        >>> stage_layout(TransformerSpec(vocab_size=8, hidden=4, layers=8, heads=1), ParallelDims(2, pp=2,
        ...              virtual_stages=2), "zbv")
        [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    return [list(x) for x in _layout(spec.layers, dims.pp, dims.virtual_stages, stage_style(schedule, dims.pp))]


@lru_cache(maxsize=4096)
def _layout(layers: int, pp: int, v: int, style: str) -> tuple[tuple[int, ...], ...]:
    from lightning_4d.pipeline.partition import partition_blocks, stage_ids_for_rank

    parts = partition_blocks(layers, pp * v)
    return tuple(tuple(i for s in stage_ids_for_rank(r, pp, v, style) for i in parts[s]) for r in range(pp))


def local_params(spec: TransformerSpec, dims: ParallelDims, layers: list[int], first: bool, last: bool
                 ) -> dict[str, int]:
    """Parameters of one rank before data-parallel sharding: ``dense`` (tp-local) and ``experts`` (ep-local),
    plus ``max_layer`` (largest layer, dense + experts), ``root`` (embedding / norm / head share) and the
    per-layer lists ``layer_dense`` / ``layer_experts``.

    Example:
        >>> spec = TransformerSpec(vocab_size=8, hidden=4, layers=1, heads=1, ffn_hidden=4)
        >>> local_params(spec, ParallelDims(1), [0], True, True)["dense"] == spec.total_params()
        True
    """
    t, h = dims.tp, spec.hidden
    per_kind = {}
    for moe in (False, True):
        lp = spec._layer_kinds[moe]
        row_bias = (h if spec.out_bias else 0) + (h if (spec.mlp_bias and lp["dense_mlp"]) else 0)
        repl = lp["norms"] + lp["router"] + lp["shared_experts"] + row_bias
        per_kind[moe] = (math.ceil((lp["attention"] + lp["dense_mlp"] - row_bias) / t) + repl,
                         lp["experts"] // dims.ep)
    per_layer = [per_kind[spec.is_moe_layer(i)] for i in layers]
    dense = sum(d for d, _ in per_layer)
    experts = sum(e for _, e in per_layer)
    max_layer = max((d + e for d, e in per_layer), default=0)
    root = 0
    table = math.ceil(spec.vocab_size * h / t)
    if first:
        root += table + spec.learned_positions * h
    if last:
        root += spec.norm_params + (table if (not spec.tied_embeddings or not first) else 0)
    return {"dense": dense + root, "experts": experts, "max_layer": max_layer, "root": root,
            "layer_dense": [d for d, _ in per_layer], "layer_experts": [e for _, e in per_layer]}


def activation_coefficients(spec: TransformerSpec, layer: int, train: TrainSpec) -> dict[str, float]:
    """The ``s·b·h`` coefficients of one layer (module docstring): ``R``, ``T_attn``, ``T_mlp``,
    ``scores`` (``5·a·s/h`` or 0) and whether ``T_mlp`` is an MoE part (``moe``, 1.0 or 0.0).

    Example:
        >>> gpt = TransformerSpec(vocab_size=8, hidden=32, layers=1, heads=4, gated_mlp=False, seq_len=16)
        >>> c = activation_coefficients(gpt, 0, TrainSpec(1, flash_attention=False, kernels="fused"))
        >>> c["R"] + c["T_attn"] + c["T_mlp"], c["scores"]
        (34.0, 10.0)
        >>> c = activation_coefficients(gpt, 0, TrainSpec(1, flash_attention=False))  # eager: the attention output twice
        >>> c["R"] + c["T_attn"] + c["T_mlp"]
        36.0
    """
    h, s = spec.hidden, train.seq(spec)
    q, kv = spec.q_width / h, spec.kv_width / h  # 1 and g/a when heads·head_dim = hidden
    if train.kernels == "eager":  # keys / values expanded to every head; the attention output kept twice
        t_attn = 2 * q + 4 * q + 2 * q + 2 * q
    else:
        t_attn = 4 * q + 4 * kv  # Korthikanti: 4 + 4·g/a
    eager_glu = spec.gated_mlp and train.kernels == "eager" and not train.compile
    inner = (8 if eager_glu else 6) if spec.gated_mlp else 4
    if spec.is_moe_layer(layer):
        t_mlp = spec.top_k * train.expert_imbalance * (2 + inner * spec.expert_hidden / h)
        t_mlp += inner * spec.shared_experts * spec.expert_hidden / h + 4 * spec.num_experts / h
    else:
        t_mlp = inner * spec.ffn_hidden / h
    no_scores = train.flash_attention or train.activation_checkpointing is not None
    scores = 0.0 if no_scores else 5 * spec.heads * s / h
    return {"R": 10.0, "T_attn": t_attn, "T_mlp": t_mlp, "scores": scores,
            "moe": 1.0 if spec.is_moe_layer(layer) else 0.0}


def layer_activation_bytes(spec: TransformerSpec, layer: int, dims: ParallelDims, train: TrainSpec, b: int) -> float:
    """Activation bytes one micro-batch of ``b`` sequences leaves in layer ``layer`` (no recomputation).

    Example:
        >>> gpt = TransformerSpec(vocab_size=8, hidden=32, layers=1, heads=4, gated_mlp=False, seq_len=16)
        >>> layer_activation_bytes(gpt, 0, ParallelDims(1), TrainSpec(1, flash_attention=False, kernels="fused"), b=1)
        22528.0
    """
    c = activation_coefficients(spec, layer, train)
    t = dims.tp
    sbh = train.seq(spec) / dims.cp * b * spec.hidden  # this rank's tokens: T/cp under context parallelism
    if dims.sp and train.kernels == "eager" and t > 1:
        # DTensor's sequence parallelism all-gathers the QKV and MLP inputs before the matmuls, which keep the
        # gathered copies for backward (Megatron keeps the shards and gathers again): 4 of R are not divided by t.
        coef = 4 + (c["R"] - 4 + c["T_attn"] + c["T_mlp"] + c["scores"]) / t
    elif dims.sp:
        coef = (c["R"] + c["T_attn"] + c["T_mlp"] + c["scores"]) / t
    else:
        mlp_div = 1 if c["moe"] else t
        coef = c["R"] + c["T_attn"] / t + c["T_mlp"] / mlp_div + c["scores"] / t
    # Context parallelism, K/V all-gather: the whole sequence's K/V (repeated to every query head, as SDPA receives
    # them), gathered for the attention, kept beyond this rank's share (attention in pieces: no mask). Ulysses keeps
    # H/cp heads of the whole sequence, the ring one remote chunk at a time: nothing beyond the 1/cp share.
    if train.cp_algorithm_for(spec, dims.cp, t) != "allgather":
        return sbh * coef * train.act_bytes / 2
    gathered = kv_gathered_bytes(b, train.seq(spec), spec.gathered_kv_width, train.act_bytes, t) * (1 - 1 / dims.cp)
    return sbh * coef * train.act_bytes / 2 + gathered


@dataclass(frozen=True)
class RankMemory:
    """Peak memory of the ranks of pipeline rank ``pp_rank`` (bytes). ``total`` is the sum of
    ``params + grads + optimizer + unsharded + activations + logits + allocator + runtime`` (``allocator``: the
    caching allocator's reserved-but-unused bytes, ``DeviceSpec.allocator_overhead`` of the rest; ``runtime``:
    what a CPU rank's process adds besides tensors, ``DeviceSpec.runtime_bytes``, 0 on GPUs). ``setup``: the
    tensors held at the set-up peak (:func:`lightning_4d.planner.setup_memory.setup_peak_bytes`); ``peak`` is the
    larger of the two peaks."""

    pp_rank: int
    layers: list[int]
    dense_params: int
    expert_params: int
    params: float
    grads: float
    optimizer: float
    unsharded: float
    activations: float
    logits: float
    in_flight: float
    micro_batch_size: int
    allocator: float = 0.0
    runtime: float = 0.0
    setup: float = 0.0

    @property
    def allocated(self) -> float:
        """Bytes of live tensors at the peak (everything but the allocator's slack)."""
        return self.params + self.grads + self.optimizer + self.unsharded + self.activations + self.logits

    @property
    def total(self) -> float:
        """Reserved bytes at the training step's peak: ``allocated + allocator + runtime``."""
        return self.allocated + self.allocator + self.runtime

    @property
    def setup_total(self) -> float:
        """Bytes at the set-up peak, before the first step: ``setup + runtime`` (set-up allocates the shards once
        and reuses one chunk of scratch: no allocator slack)."""
        return self.setup + self.runtime

    @property
    def peak(self) -> float:
        """The rank's peak over set-up and training: ``max(total, setup_total)``; what must fit the device."""
        return max(self.total, self.setup_total)

    def as_dict(self) -> dict:
        """Plain dict (with ``total``) for JSON."""
        return {**asdict(self), "total": self.total, "setup_total": self.setup_total, "peak": self.peak}


def memory_per_rank(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec,
                    layout: Optional[list[list[int]]] = None, allocator_overhead: float = 0.0,
                    runtime_bytes: float = 0.0) -> list[RankMemory]:
    """Memory of each pipeline rank (see the module docstring for every term).

    Example:
        >>> from lightning_4d.planner.spec import seed_moe_1t
        >>> seed = ParallelDims.from_world(512, tp=8, pp=4, ep=8)  # conf/parallel/moe_1t.yaml
        >>> train = TrainSpec(global_batch_size=512, microbatches=32, activation_checkpointing="full")
        >>> [round(m.total / 1e9) for m in memory_per_rank(seed_moe_1t(), seed, train)]  # GB, unsharded copies
        [229, 228, 228, 230]
    """
    from lightning_4d.planner.dp_modes import gathers_params, state_bytes

    check_layout(spec, dims)
    m = resolve_microbatches(dims, train)
    b = micro_batch_size(dims, train)
    layout = layout if layout is not None else stage_layout(spec, dims, train.schedule)
    cbytes, mode = train.act_bytes, train.data_parallel
    param_bytes = precision_info(train.precision).param_dtype.itemsize
    gathers = gathers_params(mode)
    shard, eshard = _shard_groups(dims, train)
    out = []
    for r, layers in enumerate(layout):
        first = r == 0
        last = r == stage_to_rank(dims.num_stages - 1, dims.pp, stage_style(train.schedule, dims.pp))
        lp = local_params(spec, dims, layers, first, last)
        dense, experts = lp["dense"], lp["experts"]
        st = {k: a + e for (k, a), e in zip(
            state_bytes(mode, dense, dims.dp_cp, shard, cbytes, train.optimizer_state_bytes).items(),
            state_bytes(mode, experts, dims.edp, eshard, cbytes, train.optimizer_state_bytes).values())}
        # Only wrapped parameters get gathered copies: dense ones when dp·cp > 1, experts when edp > 1.
        wd, we, root = (dense, experts, lp["root"]) if dims.dp_cp > 1 else (0, experts, 0)
        we = we if dims.edp > 1 else 0
        layer = max((d * (dims.dp_cp > 1) + e * (dims.edp > 1)
                     for d, e in zip(lp["layer_dense"], lp["layer_experts"])), default=0)
        if mode == "replicate":
            unsharded = 2 * cbytes * layer if cbytes == 2 else 0
        elif not gathers:  # ZeRO-1/2 keep the parameters; ZeRO-2 reduce-scatters one layer's fp32 grads at a time
            unsharded = 4 * layer if mode == "zero2" else 0
        else:
            keep_params = dims.pp > 1 or train.reshard_after_forward is False
            keep_grads = dims.pp > 1 or m > 1
            unsharded = cbytes * (wd + we) if keep_params else 2 * cbytes * layer + cbytes * root
            unsharded += 4 * (wd + we) if keep_grads else 4 * layer
        kinds = [spec.is_moe_layer(i) for i in layers]
        per_kind = {k: layer_activation_bytes(spec, layers[kinds.index(k)], dims, train, b) for k in set(kinds)}
        per_mb = sum(per_kind[k] for k in kinds)
        inflight = in_flight_microbatches(train.schedule if dims.pp > 1 else "1f1b", dims.pp, m, r,
                                          dims.virtual_stages)
        if train.activation_checkpointing in ("full", "selective"):
            work = max(per_kind.values(), default=0.0)  # one block recomputed in backward
            stored = sum(saved_activation_bytes(spec, i, dims, train, b) for i in layers)
            acts = inflight * stored + work
        else:
            acts = inflight * per_mb
        logits = logits_bytes(spec, dims, train, b) if last else 0.0
        allocated = sum(st.values()) + unsharded + acts + logits
        out.append(RankMemory(r, list(layers), dense, experts, st["params"], st["grads"], st["optimizer"],
                              float(unsharded), float(acts), float(logits), inflight, b,
                              float(allocator_overhead * allocated), float(runtime_bytes)))
    largest_share = max(r.params for r in out)  # the reduced check's budget is the same on every rank
    return [replace(r, setup=float(setup_peak_bytes(spec, dims, r.params, param_bytes, train.meta_built,
                                                    largest_share))) for r in out]


def _shard_groups(dims: ParallelDims, train: TrainSpec) -> tuple[Optional[int], Optional[int]]:
    """HSDP shard-group sizes of the dense (dp) and expert (edp) states: ``dp_shard`` (default: all of dp; times
    ``cp``: with context parallelism the runtime shards over ``dp_shard × cp``) and, as the runtime wraps them
    (:func:`lightning_4d.layout.data_parallel.wrap_mode`), the experts FSDP-sharded over all of edp."""
    if train.data_parallel != "hsdp":
        return None, None
    from lightning_4d.planner.dp_modes import hsdp_groups

    _, k = hsdp_groups(dims.dp, train.dp_shard or dims.dp_shard)
    return k * dims.cp, (dims.edp if wrap_mode("hsdp", experts=True) == "fsdp" else None)


def saved_activation_bytes(spec: TransformerSpec, layer: int, dims: ParallelDims, train: TrainSpec, b: int
                           ) -> float:
    """Bytes one micro-batch leaves in a checkpointed layer until its backward (``s·b·h`` times):

    - ``full``: the block input, 1 element (``1/t`` with SP);
    - ``selective`` (``TrainSpec.selective_policy``), the package's ``"matmuls"``: block input, q, k, v,
      attention output and every projection output, ``5 + 2g/a + σ·F/h`` elements (``σ`` = 2 gated);
      TorchTitan's ``"every_other_matmul"`` (wq, wv, w1, w2 of wq, wk, wv, wo, w1, w3, w2, plus the
      attention output and the input): ``4 + g/a + F/h``. MoE layers use ``k·ι·Fe`` for ``F``.
      Everything but the input is divided by ``t`` (projection outputs are tp shards; an approximation
      for the row-parallel outputs).

    Example:
        >>> spec = TransformerSpec(vocab_size=8, hidden=32, layers=1, heads=4, ffn_hidden=64, seq_len=16)
        >>> saved_activation_bytes(spec, 0, ParallelDims(1), TrainSpec(1, activation_checkpointing="full"), 1)
        1024.0
    """
    h, t, c = spec.hidden, dims.tp, train.act_bytes
    sbh = train.seq(spec) / dims.cp * b * h  # this rank's tokens
    inp = 1.0 / t if dims.sp else 1.0
    if train.activation_checkpointing == "full":
        return sbh * inp * c
    if spec.is_moe_layer(layer):
        f = spec.top_k * train.expert_imbalance * spec.expert_hidden + spec.shared_experts * spec.expert_hidden
    else:
        f = spec.ffn_hidden
    q, kv = spec.q_width / h, spec.kv_width / h  # 1 and g/a when heads·head_dim = hidden
    up = 2 if spec.gated_mlp else 1
    if train.selective_policy == "every_other_matmul":
        rest = 2 * q + 1 + kv + f / h
    else:
        rest = 2 * q + 2 + 2 * kv + up * f / h
    return sbh * (inp + rest / t) * c


def logits_bytes(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec, b: int) -> float:
    """Bytes the loss holds at its peak on the last stage: ``s·b·V/t`` logits times ``2c + 8`` (the
    compute-dtype logits the caller holds, the fp32 log-softmax saved for backward, its fp32 gradient and
    the compute-dtype cast of that gradient), plus the head's input (gathered over tp) and its gradient,
    ``2·c·s·b·h``.

    Example:
        >>> spec = TransformerSpec(vocab_size=100, hidden=8, layers=1, heads=1, seq_len=10)
        >>> logits_bytes(spec, ParallelDims(1), TrainSpec(1), 1)
        12320.0
    """
    s, c = train.seq(spec) / dims.cp, train.act_bytes  # this rank's tokens
    return s * b * spec.vocab_size / dims.tp * (2 * c + 8) + 2 * c * s * b * spec.hidden
