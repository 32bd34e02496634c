"""Data-parallel modes: model-state bytes, gathered buffers and traffic per rank for FSDP, replicate, HSDP
and ZeRO-1/2 — pure byte formulas, one owner for what each mode keeps and sends.

Per parameter (``c`` compute bytes, 2 for bf16; fp32 master copy 4; fp32 gradient 4; ``o`` optimizer
bytes, AdamW 8) on ``n`` data-parallel ranks:

============  ===================================  ===============================================
mode          states per parameter on a rank       traffic per step (bytes a rank sends, ``P`` params)
============  ===================================  ===============================================
replicate     ``4 + 4 + o``                        all-reduce of fp32 grads: ``2(n−1)/n·4P``
fsdp          ``(4 + 4 + o)/n``                    all-gathers of ``c·P`` (per pass) + reduce-scatter
                                                   of ``4P``: ``(n−1)/n`` each (:mod:`.comm`)
hsdp          ``(4 + 4 + o)/k``, shard group ``k``  FSDP inside the group of ``k`` + all-reduce of the
                                                   ``4P/k`` shard over the ``r = n/k`` replicas
zero1         ``c + 4 + (4 + o)/n``                reduce-scatter of ``4P`` once per step + all-gather
                                                   of the updated ``c·P``: ``(n−1)/n`` each
zero2         ``c + (4 + 4 + o)/n`` (+ one         reduce-scatter of ``4P`` per micro-batch (the grads
              layer's unsharded fp32 grads)        are sharded as they are produced) + all-gather of
                                                   ``c·P`` once
============  ===================================  ===============================================

ZeRO-1/2 are Rajbhandari et al. 2020 (stages 1 and 2) with the kept parameters in the compute dtype and
an fp32 master copy sharded with the moments, as Megatron's distributed optimizer (and DeepSeek-V3)
keeps them. HSDP is FSDP2's ``fully_shard`` on a 2-D ``(dp_replicate, dp_shard)`` mesh (TorchTitan's
default across nodes): the shard group of ``k`` ranks stays inside a node, the replicas cross nodes.

``comm.py`` still models fsdp / replicate itself; it should import :func:`dp_traffic` for the other modes
(the roofline substitutes it meanwhile, :func:`lightning_4d.planner.roofline.estimate_step`).

Example:
    >>> state_bytes_per_param("zero1", n=8)
    7.5
    >>> state_bytes_per_param("hsdp", n=32, shard=8) == state_bytes_per_param("fsdp", n=8)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_4d.core.comm import wire_bytes

__all__ = ["DP_MODES", "DPTraffic", "state_bytes_per_param", "state_bytes", "gathers_params", "dp_traffic",
           "hsdp_groups"]

DP_MODES = ("fsdp", "replicate", "hsdp", "zero1", "zero2")


def _check(mode: str) -> None:
    if mode not in DP_MODES:
        raise ValueError(f"data_parallel={mode!r} is not modelled; use one of {DP_MODES}.")


def hsdp_groups(n: int, shard: Optional[int]) -> tuple[int, int]:
    """``(replicas, shard)`` of HSDP over ``n`` data-parallel ranks with shard groups of ``shard`` ranks.

    Example:
        >>> hsdp_groups(32, 8)
        (4, 8)
    """
    k = n if shard is None else min(shard, n)
    if n % k:
        raise ValueError(f"dp_shard={shard} does not divide the data-parallel degree {n}: HSDP needs "
                         f"dp = dp_replicate · dp_shard. Choose dp_shard among the divisors of {n}.")
    return n // k, k


def state_bytes_per_param(mode: str, n: int, shard: Optional[int] = None, compute_bytes: int = 2,
                          optimizer_bytes: int = 8) -> float:
    """Model-state bytes one rank keeps per parameter (module table).

    Example:
        >>> state_bytes_per_param("replicate", 8), state_bytes_per_param("fsdp", 8), state_bytes_per_param("zero2", 8)
        (16.0, 2.0, 4.0)
    """
    _check(mode)
    full = 8.0 + optimizer_bytes
    if mode == "replicate" or n == 1:
        return full
    if mode == "fsdp":
        return full / n
    if mode == "hsdp":
        return full / hsdp_groups(n, shard)[1]
    if mode == "zero1":
        return compute_bytes + 4.0 + (4.0 + optimizer_bytes) / n
    return compute_bytes + full / n


def state_bytes(mode: str, params: float, n: int, shard: Optional[int] = None, compute_bytes: int = 2,
                optimizer_bytes: int = 8) -> dict[str, float]:
    """Bytes of ``params`` parameters' states on one rank split as ``params`` (master and kept copies),
    ``grads`` and ``optimizer``. FSDP2 pads dim 0, so the shard is rounded up per rank.

    Example:
        >>> state_bytes("zero1", 800, 8)
        {'params': 2000.0, 'grads': 3200.0, 'optimizer': 800.0}
    """
    _check(mode)
    if mode == "replicate" or n == 1:
        return {"params": 4.0 * params, "grads": 4.0 * params, "optimizer": float(optimizer_bytes) * params}
    k = hsdp_groups(n, shard)[1] if mode == "hsdp" else n
    sharded = -(-params // k)
    if mode in ("fsdp", "hsdp"):
        return {"params": 4.0 * sharded, "grads": 4.0 * sharded, "optimizer": float(optimizer_bytes) * sharded}
    grads = 4.0 * params if mode == "zero1" else 4.0 * sharded
    return {"params": compute_bytes * params + 4.0 * sharded, "grads": grads,
            "optimizer": float(optimizer_bytes) * sharded}


def gathers_params(mode: str) -> bool:
    """Whether the mode all-gathers parameters around compute (FSDP-style buffers), i.e. fsdp or hsdp."""
    _check(mode)
    return mode in ("fsdp", "hsdp")


@dataclass(frozen=True)
class DPTraffic:
    """Bytes one rank sends per step for its data-parallel states: ``intra`` over the shard group (or the
    whole dp group) and ``inter`` over the replicas (HSDP), with the number of collective ``calls``."""

    shard_bytes: float
    replica_bytes: float
    calls: int


def dp_traffic(mode: str, params: float, n: int, microbatches: int = 1, gather_passes: int = 1,
               shard: Optional[int] = None, compute_bytes: int = 2, units: int = 1) -> DPTraffic:
    """Data-parallel bytes a rank sends per step for ``params`` local parameters in ``units`` wrapped units.

    ``gather_passes``: how often FSDP / HSDP all-gather a unit per step (:mod:`.comm` decides it from the
    schedule and resharding).

    Example:
        >>> dp_traffic("replicate", 1000, 4).shard_bytes
        6000.0
        >>> t = dp_traffic("hsdp", 1000, 8, shard=4)
        >>> t.shard_bytes, t.replica_bytes
        (4500.0, 1000.0)
    """
    _check(mode)
    if n == 1 or params == 0:
        return DPTraffic(0.0, 0.0, 0)
    c = float(compute_bytes)
    if mode == "replicate":
        return DPTraffic(wire_bytes("all_reduce", 4 * params, n), 0.0, units)
    if mode in ("fsdp", "hsdp"):
        r, k = hsdp_groups(n, shard) if mode == "hsdp" else (1, n)
        inside = wire_bytes("all_gather", gather_passes * c * params, k) + wire_bytes("reduce_scatter", 4 * params, k)
        across = wire_bytes("all_reduce", 4 * params / k, r)
        return DPTraffic(inside, across, units * (gather_passes + 1 + (r > 1)))
    rs_times = 1 if mode == "zero1" else microbatches
    sent = wire_bytes("reduce_scatter", rs_times * 4 * params, n) + wire_bytes("all_gather", c * params, n)
    return DPTraffic(sent, 0.0, units * (rs_times + 1))
