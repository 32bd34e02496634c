"""Compute time of one pipeline rank per step from GEMM shapes, attention and memory-bound work.

A fixed share of the peak for every matmul gets the trend of measured runs backwards (small models
run at a lower share of the peak than large ones: Narayanan et al. 2021, Table 1). Here the time of a
rank is the sum of three physically separate parts, each with constants of the device
(:class:`~lightning_4d.planner.hardware.DeviceSpec`) or of the kernels (module constants below):

- **GEMMs** (projections, MLP, experts, router, head): ``2·M·N·K`` FLOPs each at
  ``peak · gemm_efficiency(M, N, K)``, where the efficiency saturates with the GEMM's arithmetic
  intensity ``I = M·N·K / (M·K + K·N + M·N)`` (FLOPs per byte moved, for 2-byte operands):
  ``e = compute_efficiency · I / (I + gemm_half_intensity)``. Large square GEMMs run near
  ``compute_efficiency``; thin ones (tensor-parallel shards, few tokens per expert) lower.
- **Attention core** (``QKᵀ`` and ``AV``): ``4·s·d`` FLOPs per token and head forward, as GEMMs of
  shape ``(s, s, d)`` — the head dimension sets their efficiency. Flash attention skips the masked half
  of a causal sequence (the FLOP count, ``TransformerSpec.flops_per_token``, does not).
- **Memory-bound kernels** (norms, residual adds, dropout, activation functions, rotary, the
  non-flash softmax): bytes moved at ``hbm_bw``. Per token and layer forward, in elements of the
  compute dtype: ``NORM_ELEMENTS·h`` on the residual stream (divided by ``tp`` only with sequence
  parallelism: without it every tp rank repeats them), ``INNER_ELEMENTS·(F + q/k/v width)/tp`` inside
  the tensor-parallel region and, without flash attention, ``SCORE_ELEMENTS·(a/tp)·s`` for the scores.
  Backward moves ``BACKWARD_FACTOR`` times as much; ``torch.compile`` fuses them
  (``COMPILE_FACTOR``).

With ``TrainSpec.float8`` the linear layers' GEMMs run on the Float8 tensor cores: twice the bf16 peak
and twice the intensity (1-byte operands), plus the dynamic-scaling casts, memory-bound: each operand is
read for its absolute maximum and read again and written in Float8 (``FLOAT8_CAST_BYTES`` per element,
``COMPILE_FACTOR`` of it compiled); backward casts the output gradient and re-casts the operands.

On a CPU (:data:`~lightning_4d.planner.hardware.CPU`) the framework's own time per block and micro-batch
(Python, autograd, the dispatcher: :attr:`~lightning_4d.planner.hardware.DeviceSpec.layer_overhead`) is work
too; on GPUs it is 0 (kernel launches run ahead of the device). The loss and head count as one more block.

Backward GEMMs cost twice the forward ones. Recomputation adds: full — one forward of everything;
``"selective"`` (the package's policy: save matmul and attention outputs) — the memory-bound forward;
``TrainSpec.selective_policy = "every_other_matmul"`` (TorchTitan's op-level policy) — that plus half
the layers' GEMMs. The optimizer step reads and writes ``OPTIMIZER_BYTES`` per local (sharded)
parameter at ``hbm_bw``.

Example:
    >>> from lightning_4d.planner.hardware import H100
    >>> round(gemm_efficiency(8192, 8192, 8192, H100), 3) > round(gemm_efficiency(8192, 512, 128, H100), 3)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_4d.mesh import ParallelDims
from lightning_4d.planner.spec import TrainSpec, TransformerSpec

if TYPE_CHECKING:
    from lightning_4d.planner.hardware import DeviceSpec

__all__ = ["NORM_ELEMENTS", "INNER_ELEMENTS", "SCORE_ELEMENTS", "BACKWARD_FACTOR", "COMPILE_FACTOR",
           "OPTIMIZER_BYTES", "FLOAT8_CAST_BYTES", "FLOAT8_SPEEDUP", "ComputeTime", "gemm_intensity", "gemm_efficiency", "layer_gemms",
           "rank_compute_time", "optimizer_seconds"]

#: Elements of the residual stream moved per token and layer forward by norms, residual adds and dropout
#: (two norms: read + write 4; two residual adds: 6; bias/dropout/mask and the casts around them: ~6).
NORM_ELEMENTS = 16.0
#: Elements per inner (tp-sharded) channel per token forward: the activation function reads its inputs and
#: writes its output (SwiGLU 3, GeLU 2), rotary reads and writes q and k, bias adds.
INNER_ELEMENTS = 3.0
#: Elements per attention score per token forward without flash attention: scale + mask + softmax (read,
#: write) and dropout (read, write, mask).
SCORE_ELEMENTS = 5.0
#: Backward memory-bound traffic relative to forward (gradients of inputs, re-reading saved tensors).
BACKWARD_FACTOR = 2.0
#: Share of the eager memory-bound traffic left after ``torch.compile`` fuses the pointwise kernels.
COMPILE_FACTOR = 0.3
#: Bytes per element of a dynamic-scaling Float8 cast: read bf16 for the absolute maximum (2), read it again
#: (2) and write Float8 (1).
FLOAT8_CAST_BYTES = 5.0
#: Float8 tensor-core peak over the bf16 one (H100: 1979 vs 989 TFLOP/s dense).
FLOAT8_SPEEDUP = 2.0
#: Bytes per local parameter an AdamW step moves (read fp32 param, grad, two moments: 16; write param and
#: moments: 12; write the bf16 compute copy: 2).
OPTIMIZER_BYTES = 30.0


def gemm_intensity(m: float, n: float, k: float) -> float:
    """Arithmetic intensity of an ``(m×k)·(k×n)`` GEMM: ``2mnk`` FLOPs over ``2(mk + kn + mn)`` bytes.

    Example:
        >>> gemm_intensity(1024, 1024, 1024)
        341.3333333333333
    """
    if min(m, n, k) <= 0:
        return 0.0
    return m * n * k / (m * k + k * n + m * n)


def gemm_efficiency(m: float, n: float, k: float, device: "DeviceSpec") -> float:
    """Share of the device's peak an ``(m×k)·(k×n)`` GEMM reaches: a saturating curve of its intensity,
    ``compute_efficiency · I / (I + gemm_half_intensity)``.

    Example:
        >>> from lightning_4d.planner.hardware import A100
        >>> 0.0 < gemm_efficiency(2048, 2304, 768, A100) < gemm_efficiency(2048, 25600, 3200, A100) < 1.0
        True
    """
    i = gemm_intensity(m, n, k)
    return device.compute_efficiency * i / (i + device.gemm_half_intensity) if i else 0.0


def layer_gemms(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec, layer: int, b: int
                ) -> list[tuple[float, float, float, float]]:
    """Forward GEMMs of one layer and micro-batch on one rank: ``(M, N, K, count)`` tuples.

    Projections see all ``b·s`` tokens with weights split over ``tp``; routed experts see the tokens the
    ``ep`` group sends them (``ep·(b·s/tp)·k·ι/E`` per local expert under SP); the router and shared
    experts see the rank's sequence shard.

    Example:
        >>> spec = TransformerSpec(vocab_size=8, hidden=64, layers=1, heads=4, ffn_hidden=128, seq_len=16)
        >>> sum(2 * m * n * k * c for m, n, k, c in layer_gemms(spec, ParallelDims(1), TrainSpec(1), 0, 1))  # 2·s·N
        1310720.0
    """
    t, h, d = dims.tp, spec.hidden, spec.head_dim
    tokens = float(b * train.seq(spec)) / dims.cp  # this rank's tokens: T/cp under context parallelism
    out = [(tokens, spec.heads * d / t, h, 1.0), (tokens, spec.kv_heads * d / t, h, 2.0),
           (tokens, h, spec.heads * d / t, 1.0)]
    up = 2.0 if spec.gated_mlp else 1.0
    if spec.is_moe_layer(layer):
        shard = tokens / t if dims.sp else tokens
        per_expert = dims.ep * shard * spec.top_k * train.expert_imbalance / spec.num_experts
        local = spec.num_experts / dims.ep
        fe = spec.expert_hidden
        out += [(per_expert, fe, h, up * local), (per_expert, h, fe, local), (shard, spec.num_experts, h, 1.0)]
        if spec.shared_experts:
            fs = spec.shared_experts * fe
            out += [(shard, fs, h, up), (shard, h, fs, 1.0)]
    else:
        f = spec.ffn_hidden / t
        out += [(tokens, f, h, up), (tokens, h, f, 1.0)]
    return out


@dataclass(frozen=True)
class ComputeTime:
    """Seconds of one rank's step by kind: ``gemm``, ``attention``, ``memory`` (memory-bound kernels),
    ``recompute`` (extra forward work of activation checkpointing), ``host`` (framework time per block and
    micro-batch that no device work hides: :attr:`~lightning_4d.planner.hardware.DeviceSpec.layer_overhead`, 0 on
    GPUs) and ``total``."""

    gemm: float
    attention: float
    memory: float
    recompute: float
    host: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the parts."""
        return self.gemm + self.attention + self.memory + self.recompute + self.host


def _memory_elements(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec, layer: int) -> float:
    """Memory-bound elements moved per token and layer forward on one rank (module docstring)."""
    t, h, s = dims.tp, spec.hidden, train.seq(spec)
    if spec.is_moe_layer(layer):
        inner = spec.top_k * train.expert_imbalance * spec.expert_hidden + spec.shared_experts * spec.expert_hidden
        inner_div = 1.0  # experts are whole matrices on the ep ranks; tokens come from the rank's shard
        inner_tokens = 1.0 / t if dims.sp else 1.0
    else:
        inner, inner_div, inner_tokens = float(spec.ffn_hidden), float(t), 1.0
    qkv = (spec.heads + 2 * spec.kv_heads) * spec.head_dim / t
    elems = NORM_ELEMENTS * h / (t if dims.sp else 1)
    elems += INNER_ELEMENTS * (inner * inner_tokens / inner_div + qkv)
    if not train.flash_attention:
        elems += SCORE_ELEMENTS * spec.heads / t * s
    return elems


def rank_compute_time(spec: TransformerSpec, dims: ParallelDims, train: TrainSpec, device: "DeviceSpec",
                      layers: list[int], last: bool, b: int, microbatches: int) -> ComputeTime:
    """Compute seconds of one rank per step (module docstring).

    Example:
        >>> from lightning_4d.planner.hardware import H100
        >>> spec = TransformerSpec(vocab_size=128, hidden=1024, layers=2, heads=8, seq_len=1024)
        >>> t = rank_compute_time(spec, ParallelDims(1), TrainSpec(8), H100, [0, 1], True, b=8, microbatches=1)
        >>> t.gemm > t.attention > 0 and t.recompute == 0
        True
    """
    s, c = train.seq(spec), train.act_bytes
    sq = s / dims.cp  # this rank's queries (context parallelism); keys: the whole sequence
    peak, bw = device.peak_flops, device.hbm_bw
    gemm_fwd = attn_fwd = mem_fwd = proj_fwd = 0.0
    kinds: dict[bool, tuple[float, float, float, float]] = {}
    for i in layers:
        moe = spec.is_moe_layer(i)
        if moe not in kinds:
            g = p = 0.0
            cast = 0.0  # Float8 cast bytes per forward (both operands)
            for m, n, k, count in layer_gemms(spec, dims, train, i, b):
                if train.float8:  # 1-byte operands: twice the intensity at twice the peak
                    eff = gemm_efficiency(2 * m, 2 * n, 2 * k, device)
                    g += count * 2 * m * n * k / (FLOAT8_SPEEDUP * peak * eff)
                    cast += count * FLOAT8_CAST_BYTES * (m * k + k * n)
                else:
                    g += count * 2 * m * n * k / (peak * gemm_efficiency(m, n, k, device))
            kinds[moe] = (g, g, _memory_elements(spec, dims, train, i), cast)
        g, p, e, cast = kinds[moe]
        gemm_fwd += g
        proj_fwd += p
        mem_fwd += e * b * sq * c / bw + cast / bw
    heads = spec.heads / dims.tp
    if layers:
        eff = gemm_efficiency(sq, s, spec.head_dim, device) * device.attention_efficiency
        causal = 0.5 if train.flash_attention else 1.0  # zigzag: every cp rank gets its half of the pairs
        attn_fwd = len(layers) * b * heads * 4 * sq * s * spec.head_dim * causal / (peak * eff)
    if last:
        m, n, k = b * sq, spec.vocab_size / dims.tp, spec.hidden
        gemm_fwd += 2 * m * n * k / (peak * gemm_efficiency(m, n, k, device))
        mem_fwd += b * sq * n * 6.0 / bw  # logits: cast to fp32, softmax statistics, gradient (fp32)
    factor = COMPILE_FACTOR if train.compile else 1.0
    mem_fwd *= factor
    ac = train.activation_checkpointing
    if ac == "full":
        redo = gemm_fwd + attn_fwd + mem_fwd
    elif ac == "selective":
        redo = mem_fwd + (0.5 * proj_fwd if train.selective_policy == "every_other_matmul" else 0.0)
    else:
        redo = 0.0
    m_ = microbatches
    host = device.layer_overhead * (len(layers) + (1 if last else 0)) * m_
    return ComputeTime(3 * gemm_fwd * m_, 3 * attn_fwd * m_, (1 + BACKWARD_FACTOR) * mem_fwd * m_, redo * m_, host)


def optimizer_seconds(local_params: float, device: "DeviceSpec") -> float:
    """Seconds of the AdamW step on ``local_params`` (sharded) parameters: ``OPTIMIZER_BYTES`` each at
    ``hbm_bw``.

    Example:
        >>> from lightning_4d.planner.hardware import H100
        >>> round(optimizer_seconds(1e9, H100) * 1e3, 1)  # ms for 1 B local parameters
        9.0
    """
    return local_params * OPTIMIZER_BYTES / device.hbm_bw
