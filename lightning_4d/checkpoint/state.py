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

__all__ = ["model_state_dict", "optimizer_state_dict", "save_sharded", "load_sharded", "is_checkpoint",
           "check_checkpoint", "META_FILE"]

META_FILE = "meta.pt"
_COMPLETE = ".complete"


def _options(optimizer: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened optimizer keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") do not depend on which
    # parameters a rank holds, so pipeline stages and any resharding load them.
    return StateDictOptions(full_state_dict=False, cpu_offload=False, flatten_optimizer_state_dict=optimizer)


def _perms(model: nn.Module) -> dict[str, Any]:
    from lightning_4d.tensor_parallel.layouts import permutations_of

    return permutations_of(model)


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's shards of the model state, keyed by the original parameter names, in the user's own
    layout (fused projections that tensor parallelism permuted are stored unpermuted).

    Example:
        >>> sorted(model_state_dict(nn.Linear(1, 1)))
        ['bias', 'weight']
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lightning_4d.tensor_parallel.layouts import canonical_state

    return canonical_state(get_model_state_dict(model, options=_options()), _perms(model))


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (any other object unchanged)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_state_dict(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's shards of the optimizer state, keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_4d.tensor_parallel.layouts import canonical_state

    optimizer = _unwrap_optimizer(optimizer)
    return canonical_state(get_optimizer_state_dict(model, optimizer, options=_options(optimizer=True)), _perms(model))


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory.

    Example:
        >>> is_checkpoint("does/not/exist")
        False
    """
    p = Path(path)
    return p.is_dir() and (p / _COMPLETE).exists() and (p / META_FILE).exists()


def check_checkpoint(path: str | os.PathLike) -> Path:
    """Raise a clear error unless ``path`` is a complete sharded checkpoint.

    Example:
        >>> check_checkpoint("nowhere")
        Traceback (most recent call last):
        ...
        FileNotFoundError: nowhere is not a lightning_4d checkpoint: no such directory.
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{path} is not a lightning_4d checkpoint: no such directory.")
    if p.name.endswith(".partial"):
        raise ValueError(f"{path} is an interrupted save (a '.partial' directory); use the previous checkpoint.")
    for required in (_COMPLETE, META_FILE, ".metadata"):
        if not (p / required).exists():
            raise FileNotFoundError(
                f"{path} is not a complete lightning_4d checkpoint: {p / required} is missing (interrupted or "
                f"foreign directory)."
            )
    return p


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
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")  # every rank's own random streams
    if dist.is_initialized():
        dist.barrier()
    if is_global_zero:
        torch.save(checkpoint, tmp / META_FILE)
        (tmp / _COMPLETE).touch()
        old = final.with_name(final.name + ".old")
        if final.exists():
            os.replace(final, old)  # the previous checkpoint stays whole until the new one is in place
        os.replace(tmp, final)
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    if dist.is_initialized():
        dist.barrier()


def load_sharded(path: str, model: nn.Module, optimizers: Iterable[Any]) -> dict[str, Any]:
    """Load model and optimizer shards from ``path`` into the live objects; return the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    check_checkpoint(path)
    optimizers = [_unwrap_optimizer(o) for o in optimizers]
    state: dict[str, Any] = {"model": model_state_dict(model)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state_dict(model, opt)
    try:
        dcp.load(state, checkpoint_id=path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        raise ValueError(
            f"Could not load {path}: {_first_line(err)}. The checkpoint is damaged or belongs to another model "
            f"(parameter names or shapes differ); the live model and optimizer may be partially loaded."
        ) from err
    from lightning_4d.tensor_parallel.layouts import sharded_state

    perms = _perms(model)
    set_model_state_dict(model, sharded_state(state["model"], perms), options=_options())
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, sharded_state(state[f"optimizer_{i}"], perms),
                                 options=_options(optimizer=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = Path(path) / f"rng_rank{rank}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    return torch.load(Path(path) / META_FILE, weights_only=False)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return next((line.strip() for line in text if "Error" in line or "Missing" in line or "size" in line),
                text[0] if text else type(err).__name__)


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
