"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), keyed by original names.

A checkpoint is a directory: DCP shards of the model and optimizer state (each rank writes only
its shards) plus ``meta.pt`` with Lightning's loop state, written by rank 0. The directory is
written under a temporary name and renamed when complete, so an interrupted save never looks
like a checkpoint.

Example:
    >>> save_sharded(checkpoint, "ckpts/step=10.ckpt", is_global_zero=True)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["model_state_dict", "optimizer_state_dict", "save_sharded", "load_sharded", "is_checkpoint", "META_FILE"]

META_FILE = "meta.pt"
_COMPLETE = ".complete"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's shards of the model state, keyed by the original parameter names.

    Example:
        >>> sorted(model_state_dict(nn.Linear(1, 1)))
        ['bias', 'weight']
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def optimizer_state_dict(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's shards of the optimizer state, keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return get_optimizer_state_dict(model, optimizer, options=_options())


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory.

    Example:
        >>> is_checkpoint("does/not/exist")
        False
    """
    p = Path(path)
    return p.is_dir() and (p / _COMPLETE).exists() and (p / META_FILE).exists()


def save_sharded(checkpoint: dict[str, Any], path: str, is_global_zero: bool) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a sharded DCP directory at ``path``, atomically."""
    import torch.distributed.checkpoint as dcp

    final = Path(path)
    tmp = final.with_name(final.name + ".partial")
    if is_global_zero:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    state = {"model": checkpoint.pop("state_dict")}
    for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = opt_state
    dcp.save(state, checkpoint_id=str(tmp))
    if is_global_zero:
        torch.save(checkpoint, tmp / META_FILE)
        (tmp / _COMPLETE).touch()
        if final.exists():
            shutil.rmtree(final) if final.is_dir() else final.unlink()
        os.replace(tmp, final)
    if dist.is_initialized():
        dist.barrier()


def load_sharded(path: str, model: nn.Module, optimizers: Iterable[Any]) -> dict[str, Any]:
    """Load model and optimizer shards from ``path`` into the live objects; return the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if not is_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete lightning_4d checkpoint (a directory with {META_FILE} and {_COMPLETE})."
        )
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
    state: dict[str, Any] = {"model": model_state_dict(model)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state_dict(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=_options())
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"], options=_options())
    return torch.load(Path(path) / META_FILE, weights_only=False)
