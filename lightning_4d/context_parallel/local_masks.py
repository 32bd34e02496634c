"""The check of the masks a model builds on its local chunk, for models whose masks the set-up check did not read.

A model built on the meta device whose reduced copy is over the set-up check's budget and that declares no window,
chunk or top-k (:func:`~.refusals.check_unread_masks`) trains with each attention call under causal attention — per
document when the batch is packed and the model is given ``position_ids`` — and the mask the call passes to SDPA is
checked against the local share of that mask. The check stays on the device (no host sync per call):
:func:`record_local_mask` keeps a flag per call, and once per step :func:`pending_flag` folds them into one value
that the step's one existing host read carries (the non-finite guard's all-reduced flags); without the guard (a
validation, test or predict step, ``nonfinite="off"``, manual optimization) :func:`verify_local_masks` makes that
read itself. A flag set on any rank raises :class:`~.shard.UnsplittableAttention` on every rank
(:func:`raise_if_differed`), naming the call, before the optimizer steps.

Example:
    >>> import torch
    >>> causal = torch.ones(4, 4, dtype=torch.bool).tril()
    >>> record_local_mask("module 'attn'", causal, torch.zeros((), dtype=torch.bool), causal)
    >>> flag = pending_flag("cpu")
    >>> float(flag), raise_if_differed(float(flag))
    (0.0, None)
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d.context_parallel.shard import UnsplittableAttention

__all__ = ["pending_flag", "raise_if_differed", "record_local_mask", "verify_local_masks"]

_STATE = threading.local()  # `pending`: (where, flag) since the last pending_flag; `taken`: those it folded


def _pending() -> list[tuple[str, Tensor]]:
    if not hasattr(_STATE, "pending"):
        _STATE.pending = []
    return _STATE.pending


def record_local_mask(where: str, allowed: Tensor, bias: Tensor, expected: Tensor) -> None:
    """Keep, on the device, whether the call ``where`` applied a mask other than ``expected``: its boolean mask
    ``allowed`` differs from ``expected`` ``(1 or B, 1, T/cp, T/cp)``, or it adds a ``bias`` (0-dim bool: values
    other than 0 and -inf). Shapes that do not broadcast are refused at once (shapes are known without a sync)."""
    try:
        torch.broadcast_shapes(allowed.shape, expected.shape)
    except RuntimeError:
        raise UnsplittableAttention(
            f"{where}: the attention mask {tuple(allowed.shape)} does not broadcast to this rank's "
            f"{tuple(expected.shape)} queries × keys: it is not built on the local sequence chunk. "
            f"{_FIX}") from None
    _pending().append((where, (allowed != expected).any() | bias))


def pending_flag(device: Any) -> Tensor:
    """``(1,)`` float on ``device``: 1 when a call recorded since the last call applied another mask than the one this
    run assumes, else 0 (no host sync); the recorded calls are kept for :func:`raise_if_differed`."""
    pending = _pending()
    flag = torch.zeros(1, device=device)
    for _, differs in pending:
        flag = torch.maximum(flag, differs.to(device=device, dtype=flag.dtype).reshape(1))
    _STATE.taken = list(pending)
    pending.clear()
    return flag


def raise_if_differed(value: float) -> None:
    """Raise, naming the first call whose mask differed on this rank (host reads: only when one did), if ``value``
    (the :func:`pending_flag` of every rank, reduced by max) is set."""
    if not value:
        return
    where = next((w for w, differs in getattr(_STATE, "taken", []) if bool(differs)), None)
    raise UnsplittableAttention(
        f"{where or 'an attention call (on another rank)'}: the attention mask it passed to "
        f"scaled_dot_product_attention is neither causal nor, for packed batches, causal within the documents of "
        f"position_ids (a prefix, padding inside the sequence, a sliding window, an additive bias such as ALiBi, or "
        f"a mask that ignores the documents), which is what this run assumed: without the set-up check's reading of "
        f"each layer's mask (the model was built on the meta device, its copy over the check's budget) context "
        f"parallelism only knows those (a training step stops before the optimizer step). {_FIX}")


def verify_local_masks(device: Any, group: Optional[dist.ProcessGroup] = None) -> None:
    """:func:`pending_flag`, all-reduced (max) over ``group`` (default: the world) and read: one host sync. Call it on
    every rank at the same point of a step."""
    flag = pending_flag(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    raise_if_differed(float(flag))  # the step's one host read of the check


_FIX = ("Build the model for real, raise FourDStrategy(reduced_check_budget=...) so that its masks are read at "
        "set-up, or use cp=1.")
