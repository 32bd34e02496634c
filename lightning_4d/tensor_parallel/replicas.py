"""Replicated parameters must stay identical on every tensor-parallel rank: a check that says which do not.

A parameter that tensor parallelism leaves whole (a norm, a bias, a per-head ``q_norm``) is updated
by every TP rank from its own gradient; if that gradient came from sharded activations and was not
summed, the copies drift apart and training goes on, silently wrong. :func:`replica_mismatches`
compares a checksum of every such parameter across the ``tp`` group (one all-gather of two float64
numbers per parameter); the strategy runs it after the first optimizer step and fails loudly.

Example:
    >>> # not run: needs a process group
    >>> replica_mismatches(lightning_module, mesh["tp"].get_group())  # doctest: +SKIP
    []
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["replica_mismatches", "replica_rtol", "replicated_over_tp"]


def replicated_over_tp(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, local tensor)`` of every parameter that each TP rank holds in full: plain tensors, and
    DTensors on the dense mesh that are ``Replicate`` on its ``tp`` dimension or do not use it (their
    local part is compared). Experts (on the ``ep`` / ``edp`` view) differ across TP ranks by design.

    Example:
        >>> [n for n, _ in replicated_over_tp(nn.Linear(2, 2))]
        ['weight', 'bias']
    """
    from torch.distributed.tensor import DTensor, Replicate

    from lightning_4d.mesh import Axis

    out = []
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            if Axis.EP.value in names or Axis.EDP.value in names:
                continue
            if Axis.TP.value in names and not isinstance(p.placements[names.index(Axis.TP.value)], Replicate):
                continue  # sharded over tp: each rank holds a different part
            out.append((name, p.to_local()))
        else:
            out.append((name, p))
    return out


def replica_rtol() -> float:
    """The relative spread :func:`replica_mismatches` accepts: ``1e-6`` with full fp32 matmuls, scaled by the
    eps of the current fp32 matmul precision (:func:`lightning_4d.core.precision.matmul_eps`: ``8.2e-3`` under TF32),
    since the step that produced the values ran at the user's precision.

    Example:
        >>> replica_rtol()
        1e-06
    """
    from lightning_4d.core.precision import MATMUL_EPS, matmul_eps

    return 1e-6 * matmul_eps() / MATMUL_EPS["highest"]


def replica_mismatches(module: nn.Module, tp_group: dist.ProcessGroup, rtol: Optional[float] = None) -> list[str]:
    """Names of TP-replicated parameters whose copies differ across ``tp_group`` by more than ``rtol`` relative
    (default :func:`replica_rtol`; collective: call on every rank of the group, same module structure).

    Example:
        >>> # not run: needs a process group
        >>> replica_mismatches(lm, mesh["tp"].get_group())  # doctest: +SKIP
        []
    """
    params = replicated_over_tp(module)
    if not params:
        return []
    sums = []
    for _, t in params:
        flat = t.detach().flatten().double()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        sums.append(torch.stack([flat.sum(), (flat * weights).sum() / max(flat.numel(), 1)]))
    local = torch.stack(sums)  # (P, 2)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(gathered, local, group=tp_group)
    every = torch.stack(gathered)  # (tp, P, 2)
    spread = (every.max(0).values - every.min(0).values).abs().amax(-1)  # (P,)
    scale = every.abs().amax(0).amax(-1).clamp_min(1e-12)  # (P,)
    rtol = replica_rtol() if rtol is None else rtol
    return [name for (name, _), s, m in zip(params, spread.tolist(), scale.tolist()) if s > rtol * m]
