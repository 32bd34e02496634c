"""A Lightning Fabric ``state`` dict (``{"model": model, "optimizer": optimizer, "step": 3, ...}``) saved and loaded as
the Trainer strategy's sharded checkpoint (:mod:`lightning_4d.checkpoint.state`): model and optimizer shards keyed by
the model's own parameter names, so a checkpoint saved under one layout loads under another; the other entries
(``state_dict()`` of those that have one) in ``meta.pt``, with the keys the model and optimizers were saved under.

Example:
    >>> # not run: needs a process group and a set-up model
    >>> save_fabric_state("out/step-10", {"model": model, "optimizer": opt, "step": 10}, model, True)  # doctest: +SKIP
    >>> load_fabric_state("out/step-10", {"model": model, "optimizer": opt, "step": 0}, model)  # doctest: +SKIP
    {}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_4d.checkpoint.state import META_FILE, load_sharded, model_state_dict, optimizer_state_dict, save_sharded

__all__ = ["RECORD_KEY", "load_fabric_state", "save_fabric_state", "saved_optimizer_keys", "split_fabric_state"]

#: The ``meta.pt`` entry recording the state keys of the model and of the optimizers (in their saved order).
RECORD_KEY = "fourd_fabric"
_OWN_KEYS = ("state_dict", "optimizer_states", RECORD_KEY)  # the checkpoint's own entries


Unwrap = Callable[[nn.Module], nn.Module]


def split_fabric_state(state: dict[str, Any], model: Optional[nn.Module], unwrap: Unwrap = lambda m: m
                       ) -> tuple[str, dict[str, Optimizer], dict[str, Any]]:
    """``(the model's key, optimizers by key, the other entries)`` of ``state``, which must hold exactly one module:
    ``model``, the set-up model (``unwrap``: from what ``fabric.setup`` returned to it).

    Example:
        >>> net = nn.Linear(2, 2)
        >>> split_fabric_state({"model": net, "step": 3}, net)
        ('model', {}, {'step': 3})
    """
    modules = {k: unwrap(v) for k, v in state.items() if isinstance(v, nn.Module)}
    if model is None or list(modules.values()) != [model]:
        raise ValueError(f"The state must hold the one model the strategy set up, as returned by fabric.setup; got "
                         f"modules {sorted(modules)}.")
    optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
    clash = set(_OWN_KEYS) & set(rest)
    if clash:
        raise ValueError(f"state keys {sorted(clash)} are the checkpoint's own: rename them.")
    return next(iter(modules)), optimizers, rest


def save_fabric_state(path: str, state: dict[str, Any], model: Optional[nn.Module], is_global_zero: bool,
                      checksums: bool = True, unwrap: Unwrap = lambda m: m) -> None:
    """Save ``state`` (holding the set-up ``model``) at ``path``, the same on every rank, as a sharded, crash-safe DCP
    directory (:func:`~lightning_4d.checkpoint.state.save_sharded`). ``checksums``: a SHA-256 per file in the
    manifest. Collective over the world.

    Example:
        >>> # not run: needs a process group
        >>> save_fabric_state("out/ckpt", {"model": model, "optimizer": opt}, model, rank == 0)  # doctest: +SKIP
    """
    key, optimizers, rest = split_fabric_state(state, model, unwrap)
    assert model is not None
    checkpoint = {k: (v.state_dict() if _stateful(v) else v) for k, v in rest.items()}
    checkpoint.update(state_dict=model_state_dict(model),
                      optimizer_states=[optimizer_state_dict(model, o) for o in optimizers.values()],
                      **{RECORD_KEY: {"model": key, "optimizers": list(optimizers)}})
    save_sharded(checkpoint, path, is_global_zero=is_global_zero, checksums=checksums)


def load_fabric_state(path: str, state: dict[str, Any], model: Optional[nn.Module], strict: bool = True,
                      verify: bool = True, unwrap: Unwrap = lambda m: m) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_fabric_state` (saved under any layout) into ``state``'s model and optimizers,
    in place; the other entries are restored (``load_state_dict`` where they have one, else replaced in ``state``)
    and what ``state`` did not ask for is returned. ``strict=False`` loads the parameters both sides have and skips
    entries the checkpoint lacks; ``verify``: check the files' checksums (else their sizes). Collective over the world.

    Example:
        >>> # not run: needs a process group
        >>> load_fabric_state("out/ckpt", {"model": model, "optimizer": opt}, model)  # doctest: +SKIP
        {}
    """
    _, optimizers, rest = split_fabric_state(state, model, unwrap)
    assert model is not None
    saved = saved_optimizer_keys(path)
    order = list(optimizers) if saved is None else saved  # the saved positions of the optimizers' states
    if optimizers and set(order) != set(optimizers):
        raise KeyError(f"{path} holds the optimizer states of {order} but state has the optimizers "
                       f"{sorted(optimizers)}: pass them all under the keys they were saved with, or none (the model "
                       f"only).")
    order = order if optimizers else []
    meta = load_sharded(path, model, [optimizers[k] for k in order], verify=verify, strict=strict,
                        relax="Pass fabric.load(..., strict=False)")
    meta.pop(RECORD_KEY, None)
    absent = [k for k in rest if k not in meta]
    if absent and strict:
        raise KeyError(f"{path} has no entry {absent}; it holds {sorted(meta)}. Pass strict=False to skip them.")
    for key, obj in rest.items():
        if key in meta:
            if _stateful(obj):
                obj.load_state_dict(meta.pop(key))
            else:
                state[key] = meta.pop(key)
    return meta


def saved_optimizer_keys(path: str) -> Optional[list[str]]:
    """The state keys a checkpoint's optimizers were saved under, in their order (read from its ``meta.pt``);
    ``None`` when that cannot be read here (no checkpoint yet, an interrupted swap): the load then names the problem.

    Example:
        >>> saved_optimizer_keys("no/such/checkpoint") is None
        True
    """
    try:
        meta = torch.load(Path(path) / META_FILE, weights_only=False)
    except Exception:  # noqa: BLE001 - load_sharded recovers or refuses the checkpoint, naming the file
        return None
    record = meta.get(RECORD_KEY) if isinstance(meta, dict) else None
    return list(record["optimizers"]) if isinstance(record, dict) else None


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
