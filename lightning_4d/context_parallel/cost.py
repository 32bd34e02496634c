"""What context parallelism costs, in closed form: the K/V bytes on the wire per step and the activation memory
per rank. The ring formulas are :func:`lightning_4d.core.comm.wire_bytes` (the one owner).

Per attention layer and micro-batch, every rank all-gathers K and V (one stacked tensor) in forward and
reduce-scatters their gradients in backward; activation checkpointing runs the forward, and so the all-gather,
again. The gathered tensor holds ``S = 2·b·T·w_kv/tp·c`` bytes (``w_kv``: the K/V features SDPA receives; with GQA
those are the heads repeated to every query head, ``w_kv = heads·head_dim``, whether the model repeats them itself or
leaves it to SDPA's ``enable_gqa``, which :class:`~.attention.ContextParallelAttention` repeats before gathering). Each rank
keeps the gathered K/V of every layer for backward (``S`` per layer) while its other activations fall to ``1/cp``.
The global causal mask is passed to SDPA, whose kernels turn it into an additive mask of the query dtype and keep
it for backward: ``M = T/cp · T · c`` bytes per layer (:func:`mask_bytes`; per sequence with packed documents), the
one term that grows with ``T²`` — it falls with ``cp`` too, but bounds the sequence one rank can hold.

Ulysses (:mod:`.ulysses`) exchanges instead, per layer and micro-batch, q, k and v (heads ↔ sequence) and the output
back, each an all-to-all of the rank's local tensor ``L`` that sends ``(cp−1)/cp·L``; the backward runs the same
all-to-alls on the gradients, and a recomputed forward again. Its activations all fall to ``1/cp``.

Example:
    >>> kv_gathered_bytes(batch=1, seq_len=4096, kv_width=1024, act_bytes=2)
    16777216.0
    >>> kv_wire_bytes(batch=1, seq_len=4096, kv_width=1024, layers=32, cp=2, act_bytes=2) / 2**20
    512.0
    >>> ulysses_wire_bytes(batch=1, seq_len=4096, q_width=4096, kv_width=1024, layers=32, cp=2, act_bytes=2) / 2**20
    1280.0
"""

from __future__ import annotations

from lightning_4d.core.comm import wire_bytes

__all__ = ["activation_bytes_per_rank", "kv_gathered_bytes", "kv_wire_bytes", "mask_bytes", "ulysses_wire_bytes"]


def kv_gathered_bytes(batch: int, seq_len: int, kv_width: int, act_bytes: float, tp: int = 1) -> float:
    """Bytes of one layer's gathered K and V, ``2·b·T·w_kv/tp·c`` (the whole sequence).

    Example:
        >>> kv_gathered_bytes(batch=2, seq_len=16, kv_width=8, act_bytes=4, tp=2)
        1024.0
    """
    return 2.0 * batch * seq_len * kv_width / tp * act_bytes


def kv_wire_bytes(batch: int, seq_len: int, kv_width: int, layers: int, cp: int, act_bytes: float, tp: int = 1,
                  microbatches: int = 1, recompute: bool = False) -> float:
    """Bytes one rank sends on the ``cp`` axis per step: per layer and micro-batch, ``1 + recompute`` all-gathers
    and one reduce-scatter of :func:`kv_gathered_bytes`, each ``(cp−1)/cp·S`` on a ring. ``batch``: sequences per
    micro-batch.

    Example:
        >>> kv_wire_bytes(batch=2, seq_len=16, kv_width=8, layers=2, cp=2, act_bytes=4)
        4096.0
        >>> kv_wire_bytes(batch=2, seq_len=16, kv_width=8, layers=2, cp=1, act_bytes=4)
        0.0
    """
    full = kv_gathered_bytes(batch, seq_len, kv_width, act_bytes, tp)
    per_layer = (2 if recompute else 1) * wire_bytes("all_gather", full, cp) + wire_bytes("reduce_scatter", full, cp)
    return layers * microbatches * per_layer


def ulysses_wire_bytes(batch: int, seq_len: int, q_width: int, kv_width: int, layers: int, cp: int,
                       act_bytes: float, tp: int = 1, microbatches: int = 1, recompute: bool = False) -> float:
    """Bytes one rank sends on the ``cp`` axis per step under Ulysses: per layer and micro-batch, ``2 + recompute``
    times (forward, backward, recomputed forward) the all-to-alls of q (``w_q``), k and v (``w_kv`` each) and the
    output (``w_q``), each ``(cp−1)/cp`` of the rank's ``b·T/cp·w/tp·c`` bytes. ``w_kv``: K/V features as the
    attention call receives them (a model leaving GQA to SDPA's ``enable_gqa`` sends the repeated heads,
    ``w_kv = w_q``).

    Example:
        >>> ulysses_wire_bytes(batch=2, seq_len=16, q_width=8, kv_width=8, layers=2, cp=2, act_bytes=4)
        4096.0
        >>> ulysses_wire_bytes(batch=2, seq_len=16, q_width=8, kv_width=8, layers=2, cp=1, act_bytes=4)
        0.0
    """
    local = batch * seq_len / cp * (2 * q_width + 2 * kv_width) / tp * act_bytes  # q, k, v and the output
    return layers * microbatches * (2 + recompute) * wire_bytes("all_to_all", local, cp)


def mask_bytes(seq_len: int, cp: int, act_bytes: float, masks: int = 1) -> float:
    """Bytes of the additive mask SDPA keeps for backward in one attention layer under context parallelism (K/V
    all-gather), ``masks · T/cp · T · c`` (``masks``: 1 for one causal mask broadcast over the batch, ``b`` with
    packed documents); 0 without context parallelism (the model's own causal attention needs no mask).

    Example:
        >>> mask_bytes(seq_len=8, cp=2, act_bytes=4)
        128.0
        >>> mask_bytes(seq_len=8, cp=1, act_bytes=4)
        0.0
    """
    return float(masks * seq_len // cp * seq_len * act_bytes) if cp > 1 else 0.0


def activation_bytes_per_rank(activation_bytes: float, batch: int, seq_len: int, kv_width: int, layers: int,
                              cp: int, act_bytes: float, tp: int = 1, algorithm: str = "allgather") -> float:
    """A rank's activation bytes under context parallelism from those of the same micro-batch without it
    (``activation_bytes``, whole sequence): ``1/cp`` of them, plus with ``algorithm="allgather"`` per layer the
    gathered K/V kept for backward beyond its own share, ``(1 − 1/cp)·S``, and the additive mask :func:`mask_bytes`
    (Ulysses keeps ``H/cp`` heads of the whole sequence and passes SDPA no mask for causal attention: ``1/cp``).

    Example:
        >>> activation_bytes_per_rank(8e9, batch=1, seq_len=16384, kv_width=1024, layers=32, cp=4, act_bytes=2) / 1e9
        7.905580032
        >>> activation_bytes_per_rank(8e9, 1, 16384, 1024, 32, cp=4, act_bytes=2, algorithm="ulysses") / 1e9
        2.0
    """
    if cp == 1 or algorithm == "ulysses":
        return float(activation_bytes) / cp
    gathered = kv_gathered_bytes(batch, seq_len, kv_width, act_bytes, tp)
    return activation_bytes / cp + layers * (gathered * (1 - 1 / cp) + mask_bytes(seq_len, cp, act_bytes))
