"""Cut one batch along the sequence for this context-parallel rank (zigzag, :mod:`.zigzag`): token ids, targets
and positions. Positions are always global: a model that takes ``position_ids`` gets this rank's share of them
(``0..T-1``, or the packed documents' own), so rotary embeddings see the positions of the whole sequence.

Example:
    >>> tokens, targets = torch.arange(8)[None], torch.arange(1, 9)[None]
    >>> x, y, shard = shard_batch(tokens, targets, group=None, cp=2, rank=1, takes_positions=True)
    >>> x.tokens.tolist(), x.position_ids.tolist(), y.tolist()
    ([[2, 3, 4, 5]], [[2, 3, 4, 5]], [[3, 4, 5, 6]])
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d.core.batches import PackedInputs, batch_tokens, check_takes_positions, document_ids
from lightning_4d.context_parallel.shard import SequenceShard
from lightning_4d.context_parallel.zigzag import check_sequence_length, zigzag_indices

__all__ = ["shard_batch", "takes_positions"]


def takes_positions(module: Any) -> bool:
    """Whether ``module`` is called ``module(tokens, position_ids)`` (its forward takes a second argument).

    Example:
        >>> takes_positions(lambda tokens, position_ids=None: tokens), takes_positions(lambda tokens: tokens)
        (True, False)
    """
    try:
        check_takes_positions(module)
    except ValueError:
        return False
    return True


def shard_batch(inputs: Any, targets: Any, group: Optional[dist.ProcessGroup], cp: int, rank: int,
                takes_positions: bool, tp: int = 1, pipelined: bool = False) -> tuple[Any, Any, SequenceShard]:
    """This rank's ``(inputs, targets)`` and its :class:`SequenceShard`. ``inputs``: token ids ``(B, T)`` or
    :class:`~lightning_4d.core.batches.PackedInputs`; ``targets`` ``(B, T, …)`` (already shifted, so cutting them with
    the inputs keeps every pair). ``tp``: the sequence-parallel degree inside each chunk (for the length check).

    Raises:
        ValueError: a sequence length not divisible by ``2·cp`` (and ``cp·tp`` under sequence parallelism), targets
            that are not ``(B, T, …)`` tensors. (Packed documents under pipeline parallelism: the shard is per
            micro-batch, see :meth:`~.attention.SequenceShard.for_microbatch`.)

    Example:
        >>> x, y, _ = shard_batch(torch.zeros(1, 6), torch.zeros(1, 6), None, cp=2, rank=0, takes_positions=False)
        Traceback (most recent call last):
        ...
        ValueError: sequence length 6 is not divisible by 2·cp = 4: ...
    """
    tokens = batch_tokens(inputs)  # (B, T)
    if not isinstance(tokens, Tensor) or tokens.dim() < 2:
        raise ValueError(f"context parallelism cuts (batch, sequence) token ids; got {type(tokens).__name__} "
                         f"{tuple(getattr(tokens, 'shape', ()))}. Batch the samples.")
    B, T = tokens.shape[:2]
    check_sequence_length(T, cp, tp)
    if not isinstance(targets, Tensor) or tuple(targets.shape[:2]) != (B, T):
        raise ValueError(
            f"context parallelism cuts the targets with the inputs along the sequence, so they must be (batch, "
            f"sequence, …) like the inputs {(B, T)}; got {type(targets).__name__} "
            f"{tuple(getattr(targets, 'shape', ()))}. Use per-token targets (shifted), or cp=1.")
    idx = zigzag_indices(T, cp, rank, device=tokens.device)  # (T/cp,)
    packed = isinstance(inputs, PackedInputs)
    positions = inputs.position_ids if packed else torch.arange(T, device=tokens.device)[None]  # (B or 1, T)
    local_positions = positions.index_select(1, idx)  # (B or 1, T/cp)
    local_tokens = tokens.index_select(1, idx)  # (B, T/cp)
    shard = SequenceShard(group, cp, rank, T, global_docs=document_ids(positions) if packed else None,
                          local_docs=document_ids(local_positions) if (takes_positions or packed) else None,
                          per_microbatch=packed and pipelined, global_positions=positions if packed else None)
    if takes_positions or packed:  # packed without a positions argument: call_model refuses it
        local_inputs: Any = PackedInputs(local_tokens, local_positions.expand(B, -1))
    else:
        local_inputs = local_tokens
    return local_inputs, targets.index_select(1, idx), shard
