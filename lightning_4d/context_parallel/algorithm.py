"""Which exact algorithm runs attention across the ``cp`` ranks, chosen per model (pure, no process group).

- ``"allgather"``: K/V all-gathered along the sequence (backward: reduce-scatter); works for any head count; each
  rank keeps the gathered K/V of every layer for backward.
- ``"ulysses"``: q, k, v all-to-all from ``T/cp`` tokens of all heads to ``H/cp`` heads of all tokens and back
  (DeepSpeed-Ulysses); every activation falls to ``1/cp``; needs the query and K/V heads of every attention call,
  per tensor-parallel rank, divisible by ``cp``.
- ``"ring"``: K/V passed around the cp ranks one chunk at a time, the transfer overlapping the attention; any head
  count, activations ``1/cp``, more bytes than the others (the gradients travel the ring too).
- ``"auto"`` (the option's default): by the figures of :func:`~.cost.algorithm_figures` for the model's attention
  calls — the least activation memory beyond the ``1/cp`` share first (so never the all-gather), then the fewest
  bytes on the wire — among the algorithms the heads allow: Ulysses where the heads divide (unless narrow K/V make
  the ring send fewer bytes), else the ring.

The layout plan names the choice (``context parallel: ulysses: ...``); :func:`plan_algorithm` reads it back.

Example:
    >>> choose_algorithm("auto", [("module 'attn'", 8, 8, False)], cp=2, tp=1)
    'ulysses'
    >>> choose_algorithm("auto", [("module 'attn'", 8, 2, False)], cp=4, tp=1)
    'ring'
"""

from __future__ import annotations

from typing import Sequence

from lightning_4d.context_parallel.cost import algorithm_figures

__all__ = ["ALGORITHMS", "CP_ALGORITHMS", "DESCRIPTIONS", "AttentionHeads", "choose_algorithm", "describe",
           "heads_per_rank", "plan_algorithm"]

#: The algorithms, and the values of the ``cp_algorithm`` option.
ALGORITHMS = ("allgather", "ulysses", "ring")
CP_ALGORITHMS = ("auto", *ALGORITHMS)

#: ``(where, query heads, K/V heads, enable_gqa)`` of one traced ``scaled_dot_product_attention`` call (whole model).
AttentionHeads = tuple[str, int, int, bool]

DESCRIPTIONS = {
    "allgather": "K/V all-gathered over cp (backward: reduce-scatter), zigzag chunks, each call's mask from global "
                 "indices",
    "ulysses": "q/k/v all-to-all heads <-> sequence over cp (backward: the same all-to-all), H/cp heads of the whole "
               "sequence in global order, each call's mask from global indices",
    "ring": "K/V passed around the cp ranks one chunk per step (send/recv overlapping the attention; backward: the "
            "ring again, K/V grads travelling with them), zigzag chunks, each call's mask from global indices",
}
_LEGACY = "scaled_dot_product_attention with K/V all-gathered"  # plans saved before there were two algorithms


def describe(algorithm: str) -> str:
    """The layout plan's ``context_parallel`` text for ``algorithm``: its name, a colon, what it does.

    Example:
        >>> describe("ulysses").split(":")[0]
        'ulysses'
    """
    return f"{algorithm}: {DESCRIPTIONS[algorithm]}"


def plan_algorithm(text: str) -> str:
    """The algorithm a plan's ``context_parallel`` text names (``""`` without context parallelism).

    Raises:
        ValueError: a name that is not an algorithm.

    Example:
        >>> plan_algorithm(describe("allgather")), plan_algorithm("ulysses"), plan_algorithm("")
        ('allgather', 'ulysses', '')
    """
    if not text:
        return ""
    if text.startswith(_LEGACY):
        return "allgather"
    name = text.split(":", 1)[0].strip()
    if name not in ALGORITHMS:
        raise ValueError(f"layout plan: context_parallel {text!r} names no algorithm; start it with one of "
                         f"{', '.join(ALGORITHMS)} (e.g. 'ulysses').")
    return name


def heads_per_rank(heads: int, kv_heads: int, tp: int, enable_gqa: bool = False) -> tuple[int, int]:
    """``(query heads, K/V heads)`` one tensor-parallel rank passes to attention: the query heads split over
    ``tp``; K/V heads too when they divide, else replicated (one per rank); with ``enable_gqa`` the K/V heads are
    repeated to the query heads before the exchange.

    Example:
        >>> heads_per_rank(8, 2, tp=2), heads_per_rank(8, 2, tp=4), heads_per_rank(8, 2, tp=1, enable_gqa=True)
        ((4, 1), (2, 1), (8, 8))
    """
    q = heads // tp if heads % tp == 0 else heads
    kv = kv_heads // tp if kv_heads % tp == 0 else 1
    return (q, q) if enable_gqa else (q, kv)


def choose_algorithm(requested: str, calls: Sequence[AttentionHeads], cp: int, tp: int = 1) -> str:
    """The algorithm for a model whose attention calls are ``calls`` (:data:`AttentionHeads`, traced on the whole
    model): ``requested`` itself, or for ``"auto"`` the one :func:`~.cost.algorithm_figures` rank first (least
    memory beyond the ``1/cp`` share, then fewest bytes, summed over the calls) among those the heads allow.

    Raises:
        ValueError: an unknown ``requested``; ``"ulysses"`` for a model whose heads do not divide (naming the module
            and the counts).

    Example:
        >>> choose_algorithm("ulysses", [("module 'attn' (Attention)", 6, 6, False)], cp=4)
        Traceback (most recent call last):
        ...
        ValueError: cp_algorithm='ulysses': module 'attn' (Attention) calls scaled_dot_product_attention with 6 query and 6 K/V heads per tensor-parallel rank (tp=1), not divisible by cp=4: Ulysses splits the heads over the cp ranks. Use cp_algorithm='ring' or 'allgather' (or 'auto', which picks one), or a cp dividing both.
    """
    if requested not in CP_ALGORITHMS:
        raise ValueError(f"cp_algorithm={requested!r} is not known. Choose one of {', '.join(CP_ALGORITHMS)}.")
    if requested in ("allgather", "ring"):
        return requested
    per_rank = [(where, *heads_per_rank(heads, kv_heads, tp, gqa)) for where, heads, kv_heads, gqa in calls]
    undivided = next(((where, q, kv) for where, q, kv in per_rank if q % cp or kv % cp), None)
    if requested == "ulysses":
        if undivided is not None:
            where, q, kv = undivided
            raise ValueError(
                f"cp_algorithm='ulysses': {where} calls scaled_dot_product_attention with {q} query and {kv} K/V "
                f"heads per tensor-parallel rank (tp={tp}), not divisible by cp={cp}: Ulysses splits the heads over "
                f"the cp ranks. Use cp_algorithm='ring' or 'allgather' (or 'auto', which picks one), or a cp "
                f"dividing both.")
        return requested
    allowed = [a for a in ALGORITHMS if a != "ulysses" or undivided is None]

    def figures(algorithm: str) -> tuple[float, float]:
        totals = [algorithm_figures(algorithm, q, kv, cp) for _, q, kv in per_rank] or [(0.0, 0.0)]
        return sum(m for m, _ in totals), sum(b for _, b in totals)

    return min(allowed, key=lambda a: (figures(a), ALGORITHMS.index(a)))
