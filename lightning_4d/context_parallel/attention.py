"""Exact attention over a sequence split across the ``cp`` ranks: every ``F.scaled_dot_product_attention`` call of
the model (the user's own code, transformers' ``sdpa`` interface) is intercepted while the step runs, its keys and
values are all-gathered along the sequence (the backward reduce-scatters their gradients; Llama 3's choice for
GQA, where K/V are small) and put back in sequence order, and the mask is recomputed from *global* positions:
causal over the whole sequence for this rank's zigzag chunks, and block-diagonal per document for packed batches
(document boundaries from the global ``position_ids``), so documents stay apart across ranks.

The model's own mask is checked first: it must be what the model computes from the local chunk (plain causal, or
causal within the documents of the local ``position_ids``); any other mask (a sliding window, a prefix, an additive
bias such as ALiBi) cannot be re-expressed globally and is refused naming the module.

Example:
    >>> # not run: needs a process group
    >>> with ContextParallelAttention(shard):  # doctest: +SKIP
    ...     logits = model(local_tokens, local_positions)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_4d._compat import is_fake
from lightning_4d.context_parallel.collectives import gather_sequence

#: What the layout plan names as the context-parallel algorithm (:class:`ContextParallelAttention`).
ALGORITHM = ("scaled_dot_product_attention with K/V all-gathered over cp (backward: reduce-scatter), zigzag chunks, "
             "causal / per-document mask from global positions")
from lightning_4d.context_parallel.zigzag import restore_order, zigzag_indices

__all__ = ["ContextParallelAttention", "SequenceShard", "UnsplittableAttention", "active_attention", "causal_mask"]


class UnsplittableAttention(ValueError):
    """An attention call context parallelism cannot split exactly (named in the message)."""


def causal_mask(query_pos: Tensor, key_pos: Tensor, query_docs: Optional[Tensor] = None,
                key_docs: Optional[Tensor] = None) -> Tensor:
    """``True`` where a query may attend to a key: ``key <= query`` in global positions, and, with document ids
    ``(B, Tq)`` / ``(B, Tk)``, within the same document. Shape ``(1 or B, 1, Tq, Tk)``.

    Example:
        >>> causal_mask(torch.tensor([0, 3]), torch.arange(4))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 1, 1]]
        >>> docs = torch.tensor([[0, 0, 1, 1]])
        >>> causal_mask(torch.tensor([0, 3]), torch.arange(4), docs[:, [0, 3]], docs)[0, 0].int().tolist()
        [[1, 0, 0, 0], [0, 0, 1, 1]]
    """
    mask = (key_pos[None, :] <= query_pos[:, None])[None]  # (1, Tq, Tk)
    if query_docs is not None and key_docs is not None:
        mask = mask & (query_docs[:, :, None] == key_docs[:, None, :])  # (B, Tq, Tk)
    return mask[:, None]  # (1 or B, 1, Tq, Tk)


@dataclass
class SequenceShard:
    """This rank's share of one batch's sequence and what attention needs to stay exact.

    Attributes:
        group: the context-parallel process group (``cp`` ranks, this one at ``rank``).
        seq_len: the global sequence length ``T``.
        global_docs: document ids ``(B, T)`` of packed documents (from the global ``position_ids``), else ``None``.
        local_docs: document ids ``(1 or B, T/cp)`` the model sees in its local ``position_ids`` (``None``: the model
            is not given positions): the mask it builds from them is what :meth:`ContextParallelAttention` accepts.

    Example:
        >>> shard = SequenceShard(None, cp=2, rank=1, seq_len=8)
        >>> shard.query_pos.tolist()
        [2, 3, 4, 5]
    """

    group: Optional[dist.ProcessGroup]
    cp: int
    rank: int
    seq_len: int
    global_docs: Optional[Tensor] = None
    local_docs: Optional[Tensor] = None
    _masks: dict[str, Tensor] = field(default_factory=dict, repr=False)

    @property
    def query_pos(self) -> Tensor:
        """Global positions ``(T/cp,)`` of this rank's tokens (zigzag)."""
        return zigzag_indices(self.seq_len, self.cp, self.rank)

    def global_mask(self, documents: bool, device: torch.device) -> Tensor:
        """``(1 or B, 1, T/cp, T)``: causal from global positions, per document if ``documents``; cached."""
        key = f"global-{documents}-{device}"
        if key not in self._masks:
            q, k = self.query_pos.to(device), torch.arange(self.seq_len, device=device)
            docs = self.global_docs.to(device) if documents and self.global_docs is not None else None
            self._masks[key] = causal_mask(q, k, None if docs is None else docs[:, q], docs)
        return self._masks[key]

    def local_masks(self, device: torch.device) -> list[tuple[bool, Tensor]]:
        """The masks a model may build from its local chunk, ``(1 or B, 1, T/cp, T/cp)``, each with whether it
        separates documents: causal within the local documents (when it is given positions), plain causal."""
        key = f"local-{device}"
        if key not in self._masks:
            n = self.seq_len // self.cp
            self._masks[key] = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
        masks = []
        if self.local_docs is not None:
            docs = self.local_docs.to(device)
            masks.append((True, self._masks[key] & (docs[:, :, None] == docs[:, None, :])[:, None]))
        return masks + [(False, self._masks[key])]


def _allowed(mask: Tensor, where: str) -> Tensor:
    """A boolean mask (``True``: attend) from a boolean or additive one; an additive mask with values other than
    0 and -inf is a bias (ALiBi, relative positions) that depends on local offsets: refused."""
    if mask.dtype == torch.bool:
        return mask
    blocked = mask <= torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask == 0
    if mask.is_floating_point() and bool(((mask != 0) & ~blocked).any()):
        raise UnsplittableAttention(
            f"{where}: the attention mask adds a bias (values other than 0 and -inf, e.g. ALiBi or relative "
            f"positions), computed from the local chunk's offsets; context parallelism cannot re-express it for the "
            f"whole sequence. Use cp=1 for this model.")
    return ~blocked


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
    attends to the whole sequence: K/V all-gathered over the ``cp`` ranks (``(…, T, E)``, sequence order) and the
    mask recomputed from global positions (see the module doc). ``where()`` names the running module for errors;
    ``strict=False`` records them in ``errors`` instead of raising (the set-up check then agrees across ranks).

    Example:
        >>> # not run: needs a process group
        >>> with ContextParallelAttention(shard):  # doctest: +SKIP
        ...     y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # q (B, H, T/cp, hd)
    """

    def __init__(self, shard: SequenceShard, where: Callable[[], str] = lambda: "an attention call",
                 strict: bool = True) -> None:
        super().__init__()
        self.shard = shard
        self.where = where
        self.strict = strict  # False: a mask that cannot be split is recorded in `errors` (plain causal used)
        self.errors: list[str] = []
        self.calls = 0

    def __enter__(self) -> "ContextParallelAttention":
        _ACTIVE.stack = [*getattr(_ACTIVE, "stack", []), self]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.stack = getattr(_ACTIVE, "stack", [])[:-1]
        super().__exit__(*exc)

    def again(self) -> "ContextParallelAttention":
        """A new mode for the same batch: activation checkpointing enters it to recompute a block in backward,
        where the modes active in forward are not."""
        return ContextParallelAttention(self.shard, self.where, self.strict)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                   **rest: Any) -> Tensor:
        shard, n = self.shard, self.shard.seq_len // self.shard.cp
        if query.shape[-2] != n or key.shape[-2] != n or value.shape[-2] != n:
            raise UnsplittableAttention(
                f"{self.where()}: scaled_dot_product_attention on queries {tuple(query.shape)} and keys "
                f"{tuple(key.shape)}, but this context-parallel rank holds {n} of the {shard.seq_len} tokens: the "
                f"attention does not run on the local sequence chunk (a cache, a pooled or cross attention), so it "
                f"cannot be split. Use cp=1 for this model.")
        try:
            if attn_mask is None:
                mask = shard.global_mask(False, query.device) if is_causal else None
            elif attn_mask.is_meta or is_fake(attn_mask):
                # No values to check (the planner's dry run on fake tensors; nothing is trained): the global mask a
                # causal model gets, of the same shape. A real run checks the mask at set-up and in every step.
                mask = shard.global_mask(shard.global_docs is not None, query.device)
            else:
                mask = self._global_mask(_allowed(attn_mask, self.where()), query.device)
        except UnsplittableAttention as err:
            if self.strict:
                raise
            self.errors.append(str(err))  # the caller agrees with the other ranks after the forward
            mask = shard.global_mask(False, query.device)
        if rest.pop("enable_gqa", False) and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
            # K/V heads repeated as SDPA's GQA reads them (query head i uses K/V head i // rep): a model may repeat
            # them itself on one rank and not on another (transformers does when it passes a mask), and all ranks
            # must gather the same shapes.
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)  # (…, H, T/cp, E)
        keys, values = _gather_kv(key, value, shard)  # (…, T, E)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout_p,
                                              scale=scale, **rest)  # (…, T/cp, Ev)

    def _global_mask(self, allowed: Tensor, device: torch.device) -> Tensor:
        """The global mask for a model's local mask: one of :meth:`SequenceShard.local_masks`, else refused."""
        for documents, local in self.shard.local_masks(device):
            try:
                same = bool((allowed == local).all())
            except RuntimeError:  # shapes that do not broadcast
                same = False
            if same:
                return self.shard.global_mask(documents, device)
        raise UnsplittableAttention(
            f"{self.where()}: the attention mask {tuple(allowed.shape)} is neither causal nor causal within the "
            f"documents of position_ids (a sliding window, a prefix, padding inside the sequence?): context "
            f"parallelism recomputes the mask from global positions and only knows those two. Use cp=1 for this "
            f"model, or pass packed documents as position_ids.")


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
