"""Exact attention over a sequence split across the ``cp`` ranks: every ``F.scaled_dot_product_attention`` call of
the model (the user's own code, transformers' ``sdpa`` interface) is intercepted while the step runs and made
global by the plan's algorithm — ``"allgather"``: keys and values all-gathered along the sequence (the backward
reduce-scatters their gradients; Llama 3's choice for GQA, where K/V are small) and put back in sequence order;
``"ulysses"`` (:mod:`.ulysses`): q, k and v exchanged heads ↔ sequence by all-to-all; ``"ring"`` (:mod:`.ring`):
K/V passed around the cp ranks one chunk at a time. Each runs attention in pieces merged by log-sum-exp
(:mod:`.blockwise`), never a ``(T/cp × T)`` mask.

The mask is the call's own, recomputed from *global* indices: the :class:`~.masks.MaskSpec` the set-up check read
from the mask this call applied on a whole sequence (:mod:`.layer_masks`) — causal, a sliding window, causal
chunks or bidirectional, per packed document (document boundaries from the global ``position_ids``) where the call
keeps documents apart. The mask tensor the model builds on its local chunk is not read (no host sync). Without
the set-up check's masks (a model checked on the meta device only, a direct use of this class) the call runs
causal, within the documents of the local ``position_ids`` when the model is given them, and its local mask is
checked against that on the device, the flags read once per step (:mod:`.local_masks`): anything else (a prefix,
an additive bias such as ALiBi) is refused naming the module, before the optimizer step.

Example:
    >>> # not run: needs a process group
    >>> with ContextParallelAttention(shard):  # doctest: +SKIP
    ...     logits = model(local_tokens, local_positions)
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_4d._compat import is_fake
from lightning_4d.context_parallel.collectives import gather_sequence
from lightning_4d.context_parallel.kinds import SDPA, attention_kind
from lightning_4d.context_parallel.gathered import allgather_attention
from lightning_4d.context_parallel.layer_masks import LayerMasks, running
from lightning_4d.context_parallel.local_masks import record_local_mask
from lightning_4d.context_parallel.masks import MaskSpec
from lightning_4d.context_parallel.ring import ring_attention
from lightning_4d.context_parallel.shard import SequenceShard, UnsplittableAttention
from lightning_4d.context_parallel.ulysses import ulysses_attention
from lightning_4d.context_parallel.zigzag import restore_order

__all__ = ["ALGORITHMS", "ContextParallelAttention", "active_attention", "allowed_and_bias", "allowed_from",
           "bind_microbatches"]

#: The algorithms :class:`ContextParallelAttention` runs (:mod:`.algorithm` chooses).
ALGORITHMS = ("allgather", "ulysses", "ring")
#: Queries and keys per masked piece (a window's or document's edge): the largest mask one kernel call gets.
BLOCK = 1024


def allowed_and_bias(mask: Tensor) -> tuple[Tensor, Tensor]:
    """A boolean mask (``True``: attend) from a boolean or additive one, and whether the additive one is a bias
    (0-dim bool: values other than 0 and -inf, such as ALiBi), all on the device (no host sync).

    Example:
        >>> allowed, bias = allowed_and_bias(torch.tensor([0.0, float("-inf"), 1.5]))
        >>> allowed.tolist(), bool(bias)
        ([True, False, True], True)
    """
    if mask.dtype == torch.bool:
        return mask, torch.zeros((), dtype=torch.bool, device=mask.device)
    blocked = mask <= torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask == 0
    bias = ((mask != 0) & ~blocked).any() if mask.is_floating_point() else torch.zeros((), dtype=torch.bool,
                                                                                          device=mask.device)
    return ~blocked, bias


def allowed_from(mask: Tensor, where: str) -> Tensor:
    """:func:`allowed_and_bias`, a bias refused naming ``where`` (one host read: for the set-up check).

    Example:
        >>> allowed_from(torch.tensor([0.0, float("-inf")]), "attn").tolist()
        [True, False]
    """
    allowed, bias = allowed_and_bias(mask)
    if bool(bias):
        raise UnsplittableAttention(
            f"{where}: the attention mask adds a bias (values other than 0 and -inf, e.g. ALiBi or relative "
            f"positions), computed from the local chunk's offsets; context parallelism cannot re-express it for the "
            f"whole sequence. Use cp=1 for this model.")
    return allowed


_ACTIVE = threading.local()  # the modes entered on this thread, innermost last


def active_attention() -> Optional["ContextParallelAttention"]:
    """The innermost :class:`ContextParallelAttention` active on this thread, if any.

    Example:
        >>> active_attention() is None
        True
    """
    stack = getattr(_ACTIVE, "stack", [])
    return stack[-1] if stack else None


class ContextParallelAttention(TorchFunctionMode):
    """While active, every ``F.scaled_dot_product_attention(q, k, v, ...)`` on this rank's chunk ``(…, T/cp, E)``
    attends to the whole sequence under the call's own mask recomputed from global indices (see the module doc),
    by ``algorithm`` (:data:`ALGORITHMS`). ``masks``: each call's mask as the set-up check read it
    (:class:`~.layer_masks.LayerMasks`; ``None``: checked from the call's local mask instead). ``where()`` names
    the running module for errors; ``strict=False`` records them in ``errors`` instead of raising (the set-up
    check then agrees across ranks).

    Example:
        >>> # not run: needs a process group
        >>> with ContextParallelAttention(shard):  # doctest: +SKIP
        ...     y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # q (B, H, T/cp, hd)
    """

    def __init__(self, shard: SequenceShard, where: Callable[[], str] = lambda: "an attention call",
                 strict: bool = True, algorithm: str = "allgather", masks: Optional[LayerMasks] = None) -> None:
        super().__init__()
        if algorithm not in ALGORITHMS:
            raise ValueError(f"context-parallel algorithm {algorithm!r} is not known: one of {', '.join(ALGORITHMS)}.")
        self.shard = shard
        self.algorithm = algorithm
        self.masks = masks
        self.where = where
        self.strict = strict  # False: a mask that cannot be split is recorded in `errors` (plain causal used)
        self.errors: list[str] = []
        self.calls = 0
        # the shard attention uses: the batch's, or (packed under pp) the running micro-batch's, once it is known
        self.current: Optional[SequenceShard] = None if shard.per_microbatch else shard

    def __enter__(self) -> "ContextParallelAttention":
        _ACTIVE.stack = [*getattr(_ACTIVE, "stack", []), self]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.stack = getattr(_ACTIVE, "stack", [])[:-1]
        super().__exit__(*exc)

    def again(self) -> "ContextParallelAttention":
        """A new mode for the same batch (and micro-batch: created in forward): activation checkpointing enters it
        to recompute a block in backward, where the modes active in forward are not."""
        return ContextParallelAttention(self.current or self.shard, self.where, self.strict, self.algorithm,
                                        self.masks)

    def enter_microbatch(self, local_positions: Tensor) -> None:
        """A micro-batch with local ``position_ids`` ``(b, T/cp)`` enters the model (a no-op unless the shard is
        per micro-batch)."""
        if self.shard.per_microbatch:
            self.current = self.shard.for_microbatch(local_positions)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if attention_kind(func) == SDPA:
            self.calls += 1
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                   enable_gqa: bool = False) -> Tensor:
        shard, n = self.current, self.shard.seq_len // self.shard.cp
        if shard is None:
            raise UnsplittableAttention(
                f"{self.where()}: packed documents under pipeline parallelism, but the model was entered without "
                f"this micro-batch's position_ids, so its documents are not known to the attention. Call the model "
                f"as model(tokens, position_ids), or use pp=1 or cp=1 for packed batches.")
        if query.shape[-2] != n or key.shape[-2] != n or value.shape[-2] != n:
            raise UnsplittableAttention(
                f"{self.where()}: scaled_dot_product_attention on queries {tuple(query.shape)} and keys "
                f"{tuple(key.shape)}, but this context-parallel rank holds {n} of the {shard.seq_len} tokens: the "
                f"attention does not run on the local sequence chunk (a cache, a pooled or cross attention), so it "
                f"cannot be split. Use cp=1 for this model.")
        try:
            spec = self._spec(shard, attn_mask, is_causal, query.device)
        except UnsplittableAttention as err:
            if self.strict:
                raise
            self.errors.append(str(err))  # the caller agrees with the other ranks after the forward
            spec = MaskSpec()
        if spec.documents and shard.global_docs is None:  # a model's local "documents" are only the zigzag chunks
            spec = MaskSpec(spec.kind, spec.size)
        if key.dim() >= 3 and key.shape[-3] != query.shape[-3] and enable_gqa:
            # K/V heads repeated as SDPA's GQA reads them (query head i uses K/V head i // rep): a model may repeat
            # them itself on one rank and not on another (transformers does when it passes a mask), and all ranks
            # must exchange the same shapes.
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)  # (…, H, T/cp, E)
        if dropout_p > 0.0:  # dropout cannot be replayed piece by piece: SDPA on the whole keys, (T/cp × T) mask
            if self.algorithm == "ulysses":
                return ulysses_attention(query, key, value, shard, spec, self.where(), dropout_p=dropout_p,
                                         scale=scale)
            keys, values = _gather_kv(key, value, shard)  # (…, T, E)
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=shard.global_mask(spec, query.device),
                                                  dropout_p=dropout_p, scale=scale)
        if self.algorithm == "ulysses":
            return ulysses_attention(query, key, value, shard, spec, self.where(), scale=scale, block=BLOCK)
        if self.algorithm == "ring":
            return ring_attention(query, key, value, shard, spec, scale=scale, block=BLOCK)
        return allgather_attention(query, key, value, shard, spec, scale=scale, block=BLOCK)  # (…, T/cp, Ev)

    def _spec(self, shard: SequenceShard, attn_mask: Optional[Tensor], is_causal: bool,
              device: torch.device) -> MaskSpec:
        """The call's mask: as the set-up check read it (:attr:`masks`), else from its local mask (see the module
        doc)."""
        if self.masks is not None:
            frame = running()
            spec = self.masks.spec(frame)
            if spec is None:
                raise UnsplittableAttention(
                    f"{self.where()}: calls scaled_dot_product_attention where the set-up check saw no such call "
                    f"(module {self.masks.name(frame.module) if frame else 'none'!r}, call {frame.calls if frame else 0})"
                    f", so its mask is not known. The model's attention must not depend on the batch or the training "
                    f"mode; else use cp=1.")
            return spec
        if attn_mask is not None and (attn_mask.is_meta or is_fake(attn_mask)):
            # No values to check (the planner's dry run on fake tensors; nothing is trained): causal, per document
            # when the batch is packed.
            return MaskSpec(documents=True)
        if attn_mask is not None:  # causal (per document, if the model is given positions), checked on the device
            documents, expected = shard.local_masks(device)[0]
            record_local_mask(f"{self.where()} (scaled_dot_product_attention call {self.calls} of the forward)",
                              *allowed_and_bias(attn_mask), expected)
            return MaskSpec(documents=documents)
        return MaskSpec() if is_causal else MaskSpec("full")


def bind_microbatches(module: nn.Module) -> RemovableHandle:
    """A forward pre-hook on ``module`` (the model the pipeline stages call as ``module(tokens, position_ids)``) that
    tells the active :class:`ContextParallelAttention` each micro-batch's ``position_ids`` (no-op otherwise).

    Example:
        >>> handle = bind_microbatches(torch.nn.Identity())
        >>> handle.remove()
    """
    def enter(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        attention = active_attention()
        positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if attention is not None and isinstance(positions, Tensor):
            attention.enter_microbatch(positions)

    return module.register_forward_pre_hook(enter, with_kwargs=True)


def _gather_kv(key: Tensor, value: Tensor, shard: SequenceShard) -> tuple[Tensor, Tensor]:
    """All ranks' ``key``/``value`` ``(…, T/cp, E)`` as ``(…, T, E)`` in sequence order (one all-gather when the
    shapes agree)."""
    order = restore_order(shard.seq_len, shard.cp, device=key.device)  # (T,)

    def whole(gathered: Tensor) -> Tensor:  # (cp, …, T/cp, E) -> (…, T, E)
        return gathered.movedim(0, -3).flatten(-3, -2).index_select(-2, order)

    if key.shape == value.shape and key.dtype == value.dtype:
        kv = whole(gather_sequence(torch.stack([key, value]), shard.group))  # (2, …, T, E)
        return kv[0], kv[1]
    return whole(gather_sequence(key, shard.group)), whole(gather_sequence(value, shard.group))
