"""Exact attention over a sequence split across the ``cp`` ranks: every ``F.scaled_dot_product_attention`` call of
the model (the user's own code, transformers' ``sdpa`` interface) is intercepted while the step runs, its keys and
values are all-gathered along the sequence (the backward reduce-scatters their gradients; Llama 3's choice for
GQA, where K/V are small) and put back in sequence order, and the mask is recomputed from *global* positions:
causal over the whole sequence for this rank's zigzag chunks, and block-diagonal per document for packed batches
(document boundaries from the global ``position_ids``), so documents stay apart across ranks; within a sliding
window (``0 <= q - k < window`` in global positions) for a layer that declares one (:mod:`.windows`). With
``algorithm="ulysses"`` (:mod:`.ulysses`) q, k and v are instead exchanged heads ↔ sequence by all-to-all and the
mask is that of the whole sequence (:meth:`SequenceShard.whole_mask`).

The model's own mask is checked first: it must be what the model computes from the local chunk (plain causal, or
causal within the documents of the local ``position_ids``, either within the layer's window); any other mask (a
prefix, an additive bias such as ALiBi) cannot be re-expressed globally and is refused naming the module.

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
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_4d._compat import is_fake
from lightning_4d.core.batches import document_ids
from lightning_4d.context_parallel.collectives import gather_sequence
from lightning_4d.context_parallel.kinds import SDPA, attention_kind
from lightning_4d.context_parallel.ulysses import ulysses_attention
from lightning_4d.context_parallel.windows import MIXED, current_window
from lightning_4d.context_parallel.zigzag import restore_order, zigzag_indices

__all__ = ["ContextParallelAttention", "SequenceShard", "UnsplittableAttention", "active_attention",
           "bind_microbatches", "causal_mask"]


class UnsplittableAttention(ValueError):
    """An attention call context parallelism cannot split exactly (named in the message)."""


def causal_mask(query_pos: Tensor, key_pos: Tensor, query_docs: Optional[Tensor] = None,
                key_docs: Optional[Tensor] = None, window: Optional[int] = None) -> Tensor:
    """``True`` where a query may attend to a key: ``key <= query`` in global positions (and ``query - key <
    window`` with a sliding ``window``), and, with document ids ``(B, Tq)`` / ``(B, Tk)``, within the same document.
    Shape ``(1 or B, 1, Tq, Tk)``.

    Example:
        >>> causal_mask(torch.tensor([0, 3]), torch.arange(4))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 1, 1]]
        >>> docs = torch.tensor([[0, 0, 1, 1]])
        >>> causal_mask(torch.tensor([0, 3]), torch.arange(4), docs[:, [0, 3]], docs)[0, 0].int().tolist()
        [[1, 0, 0, 0], [0, 0, 1, 1]]
        >>> causal_mask(torch.tensor([3]), torch.arange(4), window=2)[0, 0].int().tolist()
        [[0, 0, 1, 1]]
    """
    distance = query_pos[:, None] - key_pos[None, :]  # (Tq, Tk)
    mask = ((distance >= 0) if window is None else ((distance >= 0) & (distance < window)))[None]  # (1, Tq, Tk)
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
        per_microbatch: packed documents under pipeline parallelism: the documents are those of each micro-batch,
            learnt when it enters the model (:meth:`for_microbatch`, :func:`bind_microbatches`), not of the batch.

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
    per_microbatch: bool = False
    _masks: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def for_microbatch(self, local_positions: Tensor) -> "SequenceShard":
        """The shard of one micro-batch whose local ``position_ids`` are ``(b, T/cp)``: its global positions
        all-gathered over the cp ranks (collective: every cp rank runs the same micro-batches in the same order)
        give its documents."""
        with torch.no_grad():
            gathered = gather_sequence(local_positions.contiguous(), self.group)  # (cp, b, T/cp)
            order = restore_order(self.seq_len, self.cp, device=local_positions.device)  # (T,)
            positions = gathered.movedim(0, 1).flatten(1).index_select(1, order)  # (b, T)
        return SequenceShard(self.group, self.cp, self.rank, self.seq_len, global_docs=document_ids(positions),
                             local_docs=document_ids(local_positions))

    @property
    def query_pos(self) -> Tensor:
        """Global positions ``(T/cp,)`` of this rank's tokens (zigzag)."""
        return zigzag_indices(self.seq_len, self.cp, self.rank)

    def global_mask(self, documents: bool, device: torch.device, window: Optional[int] = None) -> Tensor:
        """``(1 or B, 1, T/cp, T)``: causal from global positions, per document if ``documents``, within a sliding
        ``window``; cached."""
        key = f"global-{documents}-{device}-{window}"
        if key not in self._masks:
            q, k = self.query_pos.to(device), torch.arange(self.seq_len, device=device)
            docs = self.global_docs.to(device) if documents and self.global_docs is not None else None
            self._masks[key] = causal_mask(q, k, None if docs is None else docs[:, q], docs, window)
        return self._masks[key]

    def whole_mask(self, documents: bool, device: torch.device, window: Optional[int] = None) -> Tensor:
        """``(1 or B, 1, T, T)``: causal over the whole sequence in global order, per document if ``documents``,
        within a sliding ``window`` (Ulysses' mask); cached."""
        key = f"whole-{documents}-{device}-{window}"
        if key not in self._masks:
            pos = torch.arange(self.seq_len, device=device)
            docs = self.global_docs.to(device) if documents and self.global_docs is not None else None
            self._masks[key] = causal_mask(pos, pos, docs, docs, window)
        return self._masks[key]

    def local_masks(self, device: torch.device, window: Optional[int] = None) -> list[tuple[bool, Tensor]]:
        """The masks a model may build from its local chunk, ``(1 or B, 1, T/cp, T/cp)``, each with whether it
        separates documents: causal within the local documents (when it is given positions), plain causal; both
        within a sliding ``window`` of local indices (transformers' rule; the local documents split the two zigzag
        chunks, so within one the local distance is the global one)."""
        key = f"local-{device}-{window}"
        if key not in self._masks:
            n = self.seq_len // self.cp
            idx = torch.arange(n, device=device)
            self._masks[key] = causal_mask(idx, idx, window=window)  # (1, 1, T/cp, T/cp)
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
    mask recomputed from global positions (see the module doc); ``algorithm="ulysses"``: heads ↔ sequence
    all-to-all instead (:mod:`.ulysses`). ``where()`` names the running module for errors;
    ``strict=False`` records them in ``errors`` instead of raising (the set-up check then agrees across ranks).

    Example:
        >>> # not run: needs a process group
        >>> with ContextParallelAttention(shard):  # doctest: +SKIP
        ...     y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # q (B, H, T/cp, hd)
    """

    def __init__(self, shard: SequenceShard, where: Callable[[], str] = lambda: "an attention call",
                 strict: bool = True, algorithm: str = "allgather") -> None:
        super().__init__()
        if algorithm not in ("allgather", "ulysses"):
            raise ValueError(f"context-parallel algorithm {algorithm!r} is not known: 'allgather' or 'ulysses'.")
        self.shard = shard
        self.algorithm = algorithm  # "allgather" (K/V all-gather) or "ulysses" (heads <-> sequence all-to-all)
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
        return ContextParallelAttention(self.current or self.shard, self.where, self.strict, self.algorithm)

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
                   **rest: Any) -> Tensor:
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
        documents: Optional[bool] = None  # None: no mask; else causal, per document if True
        window: Optional[int] = None
        try:
            window = self._window(attn_mask, is_causal, n)
            if attn_mask is not None and (attn_mask.is_meta or is_fake(attn_mask)):
                # No values to check (the planner's dry run on fake tensors; nothing is trained): the global mask a
                # causal model gets, of the same shape. A real run checks the mask at set-up and in every step.
                documents = shard.global_docs is not None
            elif attn_mask is not None:
                documents = self._documents(shard, _allowed(attn_mask, self.where()), query.device, window)
            elif is_causal:
                documents = False
        except UnsplittableAttention as err:
            if self.strict:
                raise
            self.errors.append(str(err))  # the caller agrees with the other ranks after the forward
            documents, window = False, None
        if rest.pop("enable_gqa", False) and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
            # K/V heads repeated as SDPA's GQA reads them (query head i uses K/V head i // rep): a model may repeat
            # them itself on one rank and not on another (transformers does when it passes a mask), and all ranks
            # must gather the same shapes.
            rep = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)  # (…, H, T/cp, E)
        if self.algorithm == "ulysses":  # plain causal: SDPA's own causal mask on the whole sequence, in order
            # causal without packed documents (a model's mask from its local positions names "documents" that are
            # only the two zigzag chunks): SDPA's own causal kernel, no (T, T) mask kept for backward
            plain = window is None and (documents is False or (documents is True and shard.global_docs is None))

            def whole() -> Optional[Tensor]:
                return None if documents is None or plain else shard.whole_mask(documents, query.device, window)
            return ulysses_attention(query, key, value, shard.cp, shard.seq_len, shard.group, whole, plain,
                                     self.where(), dropout_p=dropout_p, scale=scale, **rest)
        mask = None if documents is None else shard.global_mask(documents, query.device, window)
        keys, values = _gather_kv(key, value, shard)  # (…, T, E)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout_p,
                                              scale=scale, **rest)  # (…, T/cp, Ev)

    def _window(self, attn_mask: Optional[Tensor], is_causal: bool, n: int) -> Optional[int]:
        """The sliding window of the running layer (:func:`~.windows.current_window`), checked against the call."""
        window = current_window()
        if window == MIXED:
            raise UnsplittableAttention(
                f"{self.where()}: the model's config declares a sliding window for some layer types only, and the "
                f"running attention module does not say (no `sliding_window` attribute) whether it is one of them: "
                f"context parallelism recomputes the mask from global positions and needs each layer's window. Set "
                f"`sliding_window` (int, or None) on the attention modules, or use cp=1.")
        if window is not None and attn_mask is None and is_causal and window < n:
            raise UnsplittableAttention(
                f"{self.where()}: the layer declares a sliding window of {window} tokens but calls "
                f"scaled_dot_product_attention with is_causal and no mask on its {n} local tokens, so its own "
                f"attention is not windowed: context parallelism cannot tell which of the two is meant. Use cp=1.")
        return window  # type: ignore[return-value]

    def _documents(self, shard: SequenceShard, allowed: Tensor, device: torch.device,
                   window: Optional[int] = None) -> bool:
        """Whether a model's local mask is causal within documents (``True``) or plain causal (``False``), within the
        layer's ``window``: one of :meth:`SequenceShard.local_masks`, else refused."""
        for documents, local in shard.local_masks(device, window):
            try:
                same = bool((allowed == local).all())
            except RuntimeError:  # shapes that do not broadcast
                same = False
            if same:
                return documents
        within = f" within the layer's sliding window of {window} tokens" if window is not None else ""
        raise UnsplittableAttention(
            f"{self.where()}: the attention mask {tuple(allowed.shape)} is neither causal nor causal within the "
            f"documents of position_ids{within} (a prefix, padding inside the sequence, an undeclared window?): "
            f"context parallelism recomputes the mask from global positions and only knows those. Use cp=1 for this "
            f"model, or pass packed documents as position_ids.")


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
