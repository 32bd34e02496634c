"""Which exact algorithm runs attention across the ``cp`` ranks, chosen per model (pure, no process group).

- ``"allgather"``: K/V all-gathered along the sequence (backward: reduce-scatter); works for any head count; each
  rank keeps the gathered K/V and a ``(T/cp)×T`` mask per layer.
- ``"ulysses"``: q, k, v all-to-all from ``T/cp`` tokens of all heads to ``H/cp`` heads of all tokens and back
  (DeepSpeed-Ulysses); every activation falls to ``1/cp``; needs the query and K/V heads of every attention call,
  per tensor-parallel rank, divisible by ``cp``.
- ``"auto"`` (the option's default): Ulysses where the heads divide, else all-gather.

The layout plan names the choice (``context parallel: ulysses: ...``); :func:`plan_algorithm` reads it back.

Example:
    >>> choose_algorithm("auto", [("module 'attn'", 8, 2, False)], cp=2, tp=1)
    'ulysses'
    >>> choose_algorithm("auto", [("module 'attn'", 8, 2, False)], cp=4, tp=1)
    'allgather'
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["ALGORITHMS", "CP_ALGORITHMS", "DESCRIPTIONS", "AttentionHeads", "choose_algorithm", "describe",
           "heads_per_rank", "plan_algorithm"]

#: The algorithms, and the values of the ``cp_algorithm`` option.
ALGORITHMS = ("allgather", "ulysses")
CP_ALGORITHMS = ("auto", *ALGORITHMS)

#: ``(where, query heads, K/V heads, enable_gqa)`` of one traced ``scaled_dot_product_attention`` call (whole model).
AttentionHeads = tuple[str, int, int, bool]

DESCRIPTIONS = {
    "allgather": "K/V all-gathered over cp (backward: reduce-scatter), zigzag chunks, causal / per-document mask "
                 "from global positions",
    "ulysses": "q/k/v all-to-all heads <-> sequence over cp (backward: the same all-to-all), H/cp heads of the whole "
               "sequence in global order, causal / per-document mask from global positions",
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
    model): ``requested`` itself, or for ``"auto"`` Ulysses when every call's heads per tp rank divide by ``cp``.

    Raises:
        ValueError: an unknown ``requested``; ``"ulysses"`` for a model whose heads do not divide (naming the module
            and the counts).

    Example:
        >>> choose_algorithm("ulysses", [("module 'attn' (Attention)", 6, 6, False)], cp=4)
        Traceback (most recent call last):
        ...
        ValueError: cp_algorithm='ulysses': module 'attn' (Attention) calls scaled_dot_product_attention with 6 query and 6 K/V heads per tensor-parallel rank (tp=1), not divisible by cp=4: Ulysses splits the heads over the cp ranks. Use cp_algorithm='allgather' (or 'auto', which picks it), or a cp dividing both.
    """
    if requested not in CP_ALGORITHMS:
        raise ValueError(f"cp_algorithm={requested!r} is not known. Choose one of {', '.join(CP_ALGORITHMS)}.")
    if requested == "allgather":
        return requested
    for where, heads, kv_heads, gqa in calls:
        q, kv = heads_per_rank(heads, kv_heads, tp, gqa)
        if q % cp or kv % cp:
            if requested == "auto":
                return "allgather"
            raise ValueError(
                f"cp_algorithm='ulysses': {where} calls scaled_dot_product_attention with {q} query and {kv} K/V "
                f"heads per tensor-parallel rank (tp={tp}), not divisible by cp={cp}: Ulysses splits the heads over "
                f"the cp ranks. Use cp_algorithm='allgather' (or 'auto', which picks it), or a cp dividing both.")
    return "ulysses"
