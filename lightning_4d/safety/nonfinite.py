"""The non-finite guard: stop (or skip) a step whose loss or global gradient norm is NaN/inf.

``FourDStrategy`` runs :func:`check_step` after the step's forward and backward and before gradient
clipping and the optimizer step. Each rank tests its loss and its local contribution to the squared
global gradient norm (a NaN/inf gradient or one whose square overflows) on the device — the strategy hands it the
share that gradient clipping then reuses, so the gradients are read once — and one all-reduce (max) over the
world makes the decision, so every rank stops or skips together and none waits in a collective. The flags reach
the host in one copy, the step's one host sync. Only
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


def local_flags(loss: Optional[Tensor], params: Iterable[nn.Parameter], device: Any = None,
                grad_norm_share: Optional[Tensor] = None) -> Tensor:
    """``[loss not finite, this rank's gradient norm² not finite]`` as a float tensor on ``device`` (pure, no
    collective, no host sync). ``grad_norm_share``: this rank's share of the squared global gradient norm, computed
    already (:func:`~lightning_4d.runtime.step.grad_norm_share`, which clipping reuses): then ``params`` are not
    read again.

    Example:
        >>> local_flags(torch.tensor(1.0), [], grad_norm_share=torch.tensor(float("inf"))).tolist()
        [0.0, 1.0]
    """
    flags: list[Tensor] = []
    if isinstance(loss, Tensor):
        flags.append((~torch.isfinite(loss.detach())).any())
    if grad_norm_share is None:
        by_device: dict[Any, list[Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None:
                g = local_of(p.grad)
                if g.numel():
                    by_device[g.device].append(g)
        shares = [torch.stack([n.float() for n in _compat.foreach_norm(grads, 2.0)]).pow(2).sum()
                  for grads in by_device.values()]
    else:
        shares = [grad_norm_share]
    device = device if device is not None else next((t.device for t in flags + shares), "cpu")
    loss_bad = flags[0].to(device) if flags else torch.zeros((), dtype=torch.bool, device=device)
    grad_bad = torch.zeros((), dtype=torch.bool, device=device)
    for share in shares:
        grad_bad = grad_bad | ~torch.isfinite(share.to(device))
    return torch.stack([loss_bad, grad_bad]).float()  # (2,) on the device


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
               also_max: Optional[list[float]] = None, grad_norm_share: Optional[Tensor] = None) -> Optional[str]:
    """``None`` when the step is finite on every rank, else the message (the same on every rank).

    Collective over the world: call it on every rank at the same point of the step. ``also_max``: other
    per-rank numbers to agree on in the same all-reduce (their maximum over the ranks replaces them in place;
    the preemption check rides along so that a step costs one small collective, not two). ``grad_norm_share``:
    see :func:`local_flags` (the gradients are then not read again). The flags reach the host in one copy: the
    step's one host sync.

    Example:
        >>> lin = nn.Linear(2, 1); lin(torch.ones(1, 2)).sum().backward()
        >>> check_step(lin, torch.tensor(1.0), step=0) is None
        True
    """
    from lightning_4d.core.comm import internal_comm

    flags = local_flags(loss, model.parameters(), device, grad_norm_share)
    extra = len(also_max or [])
    if extra:  # fills on the device, not a copy of host values
        flags = torch.cat([flags, *(torch.full((1,), float(v), dtype=flags.dtype, device=flags.device)
                                    for v in also_max)])  # type: ignore[union-attr]
    if dist.is_initialized() and dist.get_world_size() > 1:
        with internal_comm():  # the guard's own flag exchange, not the step's traffic
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = flags.tolist()  # the step's one host sync: every flag in one copy
    if extra:
        also_max[:] = values[2:]  # type: ignore[index]
    loss_bad, grad_bad = values[0] > 0, values[1] > 0
    if not (loss_bad or grad_bad):
        return None
    info = _describe(model, loss)
    infos = [info]
    if dist.is_initialized() and dist.get_world_size() > 1:
        infos = [None] * dist.get_world_size()
        with internal_comm():
            dist.all_gather_object(infos, info)
    what = " and ".join(w for w, bad in (("loss", loss_bad), ("global gradient norm", grad_bad)) if bad)
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
