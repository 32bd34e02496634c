"""Activation checkpointing per block: ``"full"`` recomputes the whole block in backward,
``"selective"`` saves the outputs of matrix multiplications, attention (every fused SDPA kernel, cuDNN's included)
and the reducing collectives of tensor / sequence parallelism (all-reduce, reduce-scatter, all-to-all: not sent
again in backward) and recomputes the rest (norms, activations, elementwise ops, all-gathers) — the usual trade of
TorchTitan / Megatron's selective recompute.

The block's ``forward`` is wrapped in place (no wrapper module), so parameter names and checkpoints
are unchanged.

Example:
    >>> from torch import nn
    >>> block = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    >>> apply_activation_checkpointing([block], "full")
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_4d import _compat
from lightning_4d.context_parallel.attention import active_attention

__all__ = ["apply_activation_checkpointing", "SAVE_OPS"]

# Outputs worth keeping under "selective": the expensive ops.
SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.linear.default,
    *_compat.attention_ops(),  # the fused SDPA kernels (private aten ops)
    *_compat.reducing_collective_ops(),  # DTensor's functional all-reduce / reduce-scatter / all-to-all
}


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_policy)


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def _checkpointed(forward: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    attention = active_attention()  # context parallelism: the recomputation must attend across ranks too
    if attention is None:
        extra = {"context_fn": _selective_context} if mode == "selective" else {}
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    def contexts() -> tuple[Any, Any]:
        first, again = _selective_context() if mode == "selective" else (contextlib.nullcontext(),) * 2
        return first, _both(again, attention.again())

    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts, **kwargs)


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: Optional[str]) -> None:
    """Make each block recompute its activations in backward (``mode`` = ``"full"`` | ``"selective"``).

    Example:
        >>> apply_activation_checkpointing([nn.Linear(2, 2)], None)  # None: nothing to do
    """
    if mode is None:
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing={mode!r} is not supported. Use None, 'selective' or 'full'.")
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward, mode)  # type: ignore[method-assign]
