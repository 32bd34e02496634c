"""What context parallelism costs, in closed form: the bytes on the wire per step and the activation memory per
rank, for each algorithm. The ring formulas of the collectives are :func:`lightning_4d.core.comm.wire_bytes` (the
one owner).

**All-gather.** Per attention layer and micro-batch, every rank all-gathers K and V (one stacked tensor) in forward
and reduce-scatters their gradients in backward; activation checkpointing runs the forward, and so the all-gather,
again. The gathered tensor holds ``S = 2·b·T·w_kv/tp·c`` bytes (``w_kv``: the K/V features SDPA receives; with GQA
left to SDPA's ``enable_gqa`` those are the heads repeated to every query head, ``w_kv = heads·head_dim``, which
:class:`~.attention.ContextParallelAttention` repeats before gathering). Each rank keeps the gathered K/V of every
layer for backward (``S`` per layer) while its other activations fall to ``1/cp``. Attention runs in pieces merged by
log-sum-exp (:mod:`.blockwise`): no mask is kept.

**Ulysses** (:mod:`.ulysses`) exchanges, per layer and micro-batch, q, k and v (heads ↔ sequence) and the output
back, each an all-to-all of the rank's local tensor ``L`` that sends ``(cp−1)/cp·L``; the backward runs the same
all-to-alls on the gradients, and a recomputed forward again. Its activations all fall to ``1/cp``.

**Ring** (:mod:`.ring`) sends, per layer and micro-batch, its neighbour one K/V chunk pair per step: with
``L = 2·b·T/cp·w_kv/tp·c`` (its own K and V), ``(cp−1)·L`` in forward (again when recomputed), ``(cp−1)·L`` of K/V and
``cp·L`` of their gradients in backward. It keeps nothing of the whole sequence: activations ``1/cp``.

Example:
    >>> kv_gathered_bytes(batch=1, seq_len=4096, kv_width=1024, act_bytes=2)
    16777216.0
    >>> kv_wire_bytes(batch=1, seq_len=4096, kv_width=1024, layers=32, cp=2, act_bytes=2) / 2**20
    512.0
    >>> ulysses_wire_bytes(batch=1, seq_len=4096, q_width=4096, kv_width=1024, layers=32, cp=2, act_bytes=2) / 2**20
    1280.0
    >>> ring_wire_bytes(batch=1, seq_len=4096, kv_width=1024, layers=32, cp=2, act_bytes=2) / 2**20
    1024.0
"""

from __future__ import annotations

from lightning_4d.core.comm import wire_bytes

__all__ = ["activation_bytes_per_rank", "algorithm_figures", "kv_gathered_bytes", "kv_wire_bytes", "ring_wire_bytes",
           "ulysses_wire_bytes", "wire_bytes_per_rank"]


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


def ring_wire_bytes(batch: int, seq_len: int, kv_width: int, layers: int, cp: int, act_bytes: float, tp: int = 1,
                    microbatches: int = 1, recompute: bool = False) -> float:
    """Bytes one rank sends on the ``cp`` axis per step under the ring: per layer and micro-batch, with ``L`` its own
    K and V (``2·b·T/cp·w_kv/tp·c``), ``(1 + recompute)·(cp−1)·L`` in forward, ``(cp−1)·L + cp·L`` in backward (K/V
    again, and their gradients, which travel with them and take one last hop home): point-to-point sends
    (:func:`~lightning_4d.core.comm.wire_bytes` ``"send"``).

    Example:
        >>> ring_wire_bytes(batch=2, seq_len=16, kv_width=8, layers=2, cp=2, act_bytes=4)
        8192.0
        >>> ring_wire_bytes(batch=2, seq_len=16, kv_width=8, layers=2, cp=1, act_bytes=4)
        0.0
    """
    if cp == 1:
        return 0.0
    own = wire_bytes("send", kv_gathered_bytes(batch, seq_len, kv_width, act_bytes, tp) / cp, cp)
    hops = (1 + recompute) * (cp - 1) + (cp - 1) + cp
    return layers * microbatches * hops * own


def wire_bytes_per_rank(algorithm: str, batch: int, seq_len: int, q_width: int, kv_width: int, layers: int, cp: int,
                        act_bytes: float, tp: int = 1, microbatches: int = 1, recompute: bool = False) -> float:
    """The bytes one rank sends on the ``cp`` axis per step under ``algorithm`` (the formula above for it).

    Example:
        >>> wire_bytes_per_rank("ring", 2, 16, 8, 8, 2, 2, 4) == ring_wire_bytes(2, 16, 8, 2, 2, 4)
        True
    """
    if algorithm == "ulysses":
        return ulysses_wire_bytes(batch, seq_len, q_width, kv_width, layers, cp, act_bytes, tp, microbatches,
                                  recompute)
    formula = ring_wire_bytes if algorithm == "ring" else kv_wire_bytes
    return formula(batch, seq_len, kv_width, layers, cp, act_bytes, tp, microbatches, recompute)


def activation_bytes_per_rank(activation_bytes: float, batch: int, seq_len: int, kv_width: int, layers: int,
                              cp: int, act_bytes: float, tp: int = 1, algorithm: str = "allgather") -> float:
    """A rank's activation bytes under context parallelism from those of the same micro-batch without it
    (``activation_bytes``, whole sequence): ``1/cp`` of them, plus with ``algorithm="allgather"`` per layer the
    gathered K/V kept for backward beyond its own share, ``(1 − 1/cp)·S`` (Ulysses and the ring keep nothing of the
    whole sequence: ``1/cp``).

    Example:
        >>> activation_bytes_per_rank(8e9, batch=1, seq_len=16384, kv_width=1024, layers=32, cp=4, act_bytes=2) / 1e9
        3.610612736
        >>> activation_bytes_per_rank(8e9, 1, 16384, 1024, 32, cp=4, act_bytes=2, algorithm="ring") / 1e9
        2.0
    """
    if cp == 1 or algorithm != "allgather":
        return float(activation_bytes) / cp
    gathered = kv_gathered_bytes(batch, seq_len, kv_width, act_bytes, tp)
    return activation_bytes / cp + layers * gathered * (1 - 1 / cp)


def algorithm_figures(algorithm: str, heads: int, kv_heads: int, cp: int) -> tuple[float, float]:
    """``(memory, bytes)`` of ``algorithm`` for one attention call with ``heads`` query and ``kv_heads`` K/V heads
    per tp rank, per head width and token of the rank's share: the activation memory it keeps beyond the
    ``1/cp`` share (the all-gather: the whole sequence's K/V but its own) and the bytes it sends per forward and
    backward (:func:`wire_bytes_per_rank`). What ``cp_algorithm="auto"`` compares (:mod:`.algorithm`).

    Example:
        >>> [algorithm_figures(a, 8, 8, 2) for a in ("allgather", "ulysses", "ring")]
        [(16.0, 32.0), (0.0, 32.0), (0.0, 64.0)]
    """
    extra = 2.0 * kv_heads * (cp - 1) if algorithm == "allgather" else 0.0  # S·(1 − 1/cp), per T/cp tokens
    sent = wire_bytes_per_rank(algorithm, 1, cp, heads, kv_heads, 1, cp, 1.0)  # T = cp: the share is one token
    return extra, sent
