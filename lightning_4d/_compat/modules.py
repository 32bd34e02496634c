"""``nn.Module`` and ``DataLoader`` internals, and meta-device materialisation.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2))
    >>> registered_submodule(net, "0") is net[0], registered_submodule(net, "1"), is_loss_module(nn.MSELoss())
    (True, None, True)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

__all__ = ["child_modules", "is_loss_module", "materialize_meta_module", "registered_submodule",
           "replace_batch_sampler", "swapped_parameters"]


# ---------------------------------------------------------------------------------------------- nn.Module
def child_modules(module: nn.Module) -> dict[str, nn.Module]:
    """``module``'s registered children by name, in registration order (the private ``nn.Module._modules``
    without ``None`` entries). Unlike ``named_children()``, a module registered under two names is listed
    under both."""
    return {name: child for name, child in module._modules.items() if child is not None}


def registered_submodule(root: nn.Module, path: str) -> Optional[nn.Module]:
    """The module registered at dotted ``path`` below ``root`` (``""``: ``root``), or ``None`` when a part is
    missing or set to ``None``. Walks the private ``nn.Module._modules``, so no other attribute (a
    property of a LightningModule, say) is evaluated — unlike ``get_submodule``."""
    mod: Optional[nn.Module] = root
    for part in path.split(".") if path else []:
        mod = getattr(mod, "_modules", {}).get(part) if mod is not None else None
    return mod


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block, ``module.<name>`` is the given (plain, differentiable) tensor instead of its registered
    parameter, for every ``name`` of ``tensors``; the parameters are put back afterwards, even on error. Writes
    the private ``nn.Module._parameters`` (what ``torch.func.functional_call`` does internally) so the module's
    own forward can run on, say, the local shard of a DTensor parameter without calling ``module(...)`` again
    (which would re-run its hooks)."""
    saved = {name: module._parameters[name] for name in tensors}
    try:
        for name, tensor in tensors.items():
            module._parameters[name] = tensor  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)


def is_loss_module(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's loss modules (private base ``torch.nn.modules.loss._Loss``;
    judged by the defining module where that is missing)."""
    from torch.nn.modules import loss

    base = getattr(loss, "_Loss", None)
    if base is not None:
        return isinstance(module, base)
    return type(module).__module__ == loss.__name__


def materialize_meta_module(module: nn.Module, device: torch.device) -> None:
    """Allocate meta parameters on ``device`` and re-run every module's ``reset_parameters``.

    Runs on full (unsharded) tensors, in module order, so a seeded single process and every
    rank draw identical initial weights. Modules may provide ``reset_parameters()``; the root
    may provide ``init_weights()`` which then runs last (e.g. to re-tie embeddings).
    """
    if not any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        return
    module.to_empty(device=device)
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    for sub in module.modules():
        init = getattr(sub, "init_weights", None)
        if callable(init):
            init()


# ---------------------------------------------------------------------------------------------- DataLoader
def replace_batch_sampler(dataloader: Any, batch_sampler: Any) -> None:
    """Swap ``dataloader.batch_sampler`` in place. ``DataLoader.__setattr__`` forbids it after
    construction, so this goes around the guard; it relies on the (internal) iterators reading
    ``batch_sampler`` when an iteration starts, as they do in torch 2.x."""
    object.__setattr__(dataloader, "batch_sampler", batch_sampler)
