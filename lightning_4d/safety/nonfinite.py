"""The non-finite guard: stop (or skip) a step whose loss or global gradient norm is NaN/inf.

``FourDStrategy`` runs :func:`check_step` after the step's forward and backward and before gradient
clipping and the optimizer step. Each rank tests its loss and its local contribution to the squared
global gradient norm (a NaN/inf gradient or one whose square overflows); one all-reduce (max) over the
world makes the decision, so every rank stops or skips together and none waits in a collective. Only
when a step is bad, a second exchange gathers which ranks saw what, for the message.

Example:
    >>> import torch
    >>> from torch import nn
    >>> lin = nn.Linear(2, 1); lin(torch.ones(1, 2)).sum().backward()
    >>> local_flags(torch.tensor(float("nan")), list(lin.parameters())).tolist()
    [1.0, 0.0]
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_4d import _compat
from lightning_4d.config import NONFINITE_MODES  # owned by the options
from lightning_4d.core.distributed import local_of

__all__ = ["NonFiniteError", "SkipStep", "local_flags", "check_step", "NONFINITE_MODES"]



class NonFiniteError(RuntimeError):
    """Training stopped: a step's loss or global gradient norm is not finite (raised on every rank)."""


class SkipStep(Exception):
    """Internal: the step is non-finite and the strategy skips it (``nonfinite="skip"``)."""


def local_flags(loss: Optional[Tensor], params: Iterable[nn.Parameter], device: Any = None) -> Tensor:
    """``[loss not finite, this rank's gradient norm² not finite]`` as a float tensor (pure, no collective)."""
    loss_bad = loss is not None and isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all())
    by_device: dict[Any, list[Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = local_of(p.grad)
            if g.numel():
                by_device[g.device].append(g)
    grad_bad = False
    for grads in by_device.values():
        norms = _compat.foreach_norm(grads, 2.0)
        if not bool(torch.isfinite(torch.stack([n.float() for n in norms]).pow(2).sum())):
            grad_bad = True
            break
    return torch.tensor([float(loss_bad), float(grad_bad)], device=device)


def _first_bad(named: Iterable[tuple[str, Tensor]]) -> Optional[str]:
    for name, t in named:
        if t is not None and t.numel() and not bool(torch.isfinite(local_of(t).detach()).all()):
            return name
    return None


def _describe(model: nn.Module, loss: Optional[Tensor]) -> dict[str, Any]:
    named = list(model.named_parameters())
    value = float(loss.detach().float().reshape(-1)[0]) if isinstance(loss, Tensor) and loss.numel() else None
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "loss": value,
            "grad": _first_bad((n, p.grad) for n, p in named), "param": _first_bad(named)}


def check_step(model: nn.Module, loss: Optional[Tensor], step: int, device: Any = None,
               also_max: Optional[list[float]] = None) -> Optional[str]:
    """``None`` when the step is finite on every rank, else the message (the same on every rank).

    Collective over the world: call it on every rank at the same point of the step. ``also_max``: other
    per-rank numbers to agree on in the same all-reduce (their maximum over the ranks replaces them in place;
    the preemption check rides along so that a step costs one small collective, not two).
    """
    from lightning_4d.core.comm import internal_comm

    flags = local_flags(loss, model.parameters(), device)
    extra = len(also_max or [])
    if extra:
        flags = torch.cat([flags, torch.tensor(also_max, dtype=flags.dtype, device=flags.device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        with internal_comm():  # the guard's own flag exchange, not the step's traffic
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if extra:
        also_max[:] = flags[2:].tolist()  # type: ignore[index]
        flags = flags[:2]
    if not bool(flags.any()):
        return None
    info = _describe(model, loss)
    infos = [info]
    if dist.is_initialized() and dist.get_world_size() > 1:
        infos = [None] * dist.get_world_size()
        with internal_comm():
            dist.all_gather_object(infos, info)
    what = " and ".join(w for w, bad in (("loss", flags[0]), ("global gradient norm", flags[1])) if bool(bad))
    bad_loss = sorted({i["rank"] for i in infos if i["loss"] is not None and not _finite(i["loss"])})
    bad_grad = [i for i in infos if i["grad"]]
    bad_param = [i for i in infos if i["param"]]
    parts = [f"Non-finite {what} at step {step}"]
    if bad_loss:
        parts.append(f"loss {next(i['loss'] for i in infos if i['rank'] == bad_loss[0])} on ranks {bad_loss}")
    if bad_grad:
        parts.append(f"first non-finite gradient: {bad_grad[0]['grad']} (rank {bad_grad[0]['rank']}); ranks with "
                     f"non-finite gradients {[i['rank'] for i in bad_grad]}")
    parts.append(f"first non-finite parameter: {bad_param[0]['param']} (rank {bad_param[0]['rank']})" if bad_param
                 else "parameters are still finite")
    return "; ".join(parts) + "."


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))
