"""The attention masks context parallelism knows, as the model applies them: pure math, no process group.

A layer's mask is a :class:`MaskSpec` — a predicate on ``(query index, key index)`` in the whole sequence:

- ``"causal"``: ``k <= q``;
- ``"window"``: causal within a sliding window, ``0 <= q - k < size`` (transformers' ``sliding_window_overlay``);
- ``"chunk"``: causal within fixed chunks, ``k <= q`` and ``q // size == k // size`` (Llama 4's
  ``attention_chunk_size``, transformers' ``chunked_overlay``);
- ``"full"``: every key (bidirectional attention);

each, with ``documents``, also within the packed document of the query (from the global ``position_ids``); there,
as transformers does for packed sequences, chunks start at multiples of ``size`` in the ``position_ids`` (each
document's own), windows and causality in positions are those in indices within a document.
:func:`classify_mask` reads the kind and size from the ``(T, T)`` mask a layer passes to
``F.scaled_dot_product_attention`` on a whole sequence (the set-up check, :mod:`.check`), never from an attribute
the layer may not use. :func:`plan_pieces` cuts a block of queries × keys into pieces each attention kernel call can
run without a ``(queries × keys)`` mask: pieces the mask excludes are skipped, pieces it allows wholly need no mask,
diagonal pieces are causal, and only the rest (a window's edge, a chunk boundary, packed documents) get a mask of
the piece's size.

Example:
    >>> spec = classify_mask(MaskSpec("window", 2).allowed(torch.arange(6), torch.arange(6))[0, 0])
    >>> spec, spec.describe()
    (MaskSpec(kind='window', size=2, documents=False), 'sliding window of 2 tokens')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["KINDS", "MaskSpec", "Piece", "block_kind", "classify_documents", "classify_mask", "plan_pieces"]

#: The mask kinds (see the module doc).
KINDS = ("causal", "window", "chunk", "full")


@dataclass(frozen=True)
class MaskSpec:
    """One attention call's mask (see the module doc): ``kind``, ``size`` (window or chunk tokens, else 0) and
    whether it keeps packed ``documents`` apart.

    Example:
        >>> MaskSpec("chunk", 2).allowed(torch.arange(4), torch.arange(4))[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """

    kind: str = "causal"
    size: int = 0
    documents: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"mask kind {self.kind!r} is not known: one of {', '.join(KINDS)}.")
        if (self.kind in ("window", "chunk")) != (self.size > 0):
            raise ValueError(f"mask kind {self.kind!r} with size {self.size}: windows and chunks need a size > 0, "
                             f"the other kinds none.")

    def allowed(self, query: Tensor, key: Tensor, query_docs: Optional[Tensor] = None,
                key_docs: Optional[Tensor] = None, query_pos: Optional[Tensor] = None,
                key_pos: Optional[Tensor] = None) -> Tensor:
        """``True`` where a query at sequence index ``query`` ``(Tq,)`` may attend to a key at ``key`` ``(Tk,)``;
        with document ids ``(B, Tq)`` / ``(B, Tk)`` (and ``documents``) only within a document, whose chunks
        follow the position ids ``query_pos`` / ``key_pos`` ``(B, T·)`` when given. Shape ``(1 or B, 1, Tq, Tk)``."""
        q, k = query[:, None], key[None, :]  # (Tq, 1), (1, Tk)
        if self.kind == "full":
            mask = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=query.device)[None]
        else:
            mask = (k <= q)[None]  # (1, Tq, Tk)
            if self.kind == "window":
                mask = mask & (q - k < self.size)
            elif self.kind == "chunk" and self.documents and query_pos is not None and key_pos is not None:
                mask = mask & (query_pos[:, :, None] // self.size == key_pos[:, None, :] // self.size)  # (B, Tq, Tk)
            elif self.kind == "chunk":
                mask = mask & (q // self.size == k // self.size)
        if self.documents and query_docs is not None and key_docs is not None:
            mask = mask & (query_docs[:, :, None] == key_docs[:, None, :])  # (B, Tq, Tk)
        return mask[:, None]

    def describe(self) -> str:
        """Words for messages and plans.

        Example:
            >>> MaskSpec("chunk", 8192, documents=True).describe()
            'causal within chunks of 8192 tokens, per document'
        """
        text = {"causal": "causal", "window": f"sliding window of {self.size} tokens",
                "chunk": f"causal within chunks of {self.size} tokens", "full": "bidirectional"}[self.kind]
        return text + (", per document" if self.documents else "")


def classify_mask(allowed: Tensor) -> Optional[MaskSpec]:
    """The :class:`MaskSpec` (without documents) whose mask on ``0..T-1`` is ``allowed`` ``(T, T)`` (``True``:
    attend), else ``None`` (a prefix, a mask with holes, a top-k selection: a mask context parallelism does not
    know). A window or chunk as long as the sequence reads as causal: the caller's sequence must be longer than
    any window or chunk the model may apply. Pure (one host read of a set-up tensor).

    Example:
        >>> classify_mask(torch.ones(4, 4, dtype=torch.bool).tril())
        MaskSpec(kind='causal', size=0, documents=False)
        >>> classify_mask(torch.eye(4, dtype=torch.bool).flip(0)) is None
        True
    """
    T = allowed.shape[-1]
    idx = torch.arange(T, device=allowed.device)
    if bool(allowed.all()):
        return MaskSpec("full")
    candidates = [MaskSpec("causal")]
    last = int(allowed[T - 1].sum())  # keys the last query sees: a window's size
    if 0 < last < T:
        candidates.append(MaskSpec("window", last))
    blocked = (~allowed[1:, 0]).nonzero()
    if blocked.numel():  # the first query after 0 that no longer sees key 0 starts the second chunk
        candidates.append(MaskSpec("chunk", int(blocked[0, 0]) + 1))
    for spec in candidates:
        if torch.equal(spec.allowed(idx, idx)[0, 0], allowed):
            return spec
    return None


def classify_documents(allowed: Tensor, spec: MaskSpec, docs: Tensor,
                       positions: Optional[Tensor] = None) -> Optional[bool]:
    """Whether ``allowed`` ``(B, T, T)``, a layer's mask on packed documents ``docs`` ``(B, T)`` (global indices;
    ``positions``: their ``position_ids``), is ``spec`` within each document (``True``), ``spec`` across them
    (``False``), or neither (``None``).

    Example:
        >>> docs = torch.tensor([[0, 0, 1, 1]])
        >>> within = MaskSpec(documents=True).allowed(torch.arange(4), torch.arange(4), docs, docs)[:, 0]
        >>> classify_documents(within, MaskSpec(), docs), classify_documents(within.tril(-1), MaskSpec(), docs)
        (True, None)
    """
    idx = torch.arange(docs.shape[1], device=allowed.device)
    within = MaskSpec(spec.kind, spec.size, True).allowed(idx, idx, docs, docs, positions, positions)[:, 0]
    if torch.equal(allowed, within.expand_as(allowed)):
        return True
    if torch.equal(allowed, MaskSpec(spec.kind, spec.size).allowed(idx, idx)[:, 0].expand_as(allowed)):
        return False
    return None


Range = tuple[int, int]  # [start, end) sequence indices


def block_kind(spec: MaskSpec, query: Range, key: Range) -> str:
    """How ``spec`` (its structure; documents aside) treats queries ``query`` × keys ``key`` (contiguous index
    ranges): ``"skip"`` (no pair allowed), ``"full"`` (every pair), ``"causal"`` (the same range, causal:
    the kernel's own causal flag), else ``"masked"``. Pure.

    Example:
        >>> [block_kind(MaskSpec(), (4, 8), k) for k in ((0, 4), (4, 8), (8, 12), (2, 6))]
        ['full', 'causal', 'skip', 'masked']
        >>> [block_kind(MaskSpec("window", 3), (8, 12), k) for k in ((0, 4), (4, 8), (8, 12))]
        ['skip', 'masked', 'masked']
    """
    (qs, qe), (ks, ke) = query, key
    if spec.kind == "full":
        return "full"
    low, high = qs - (ke - 1), (qe - 1) - ks  # smallest and largest q - k
    if high < 0:
        return "skip"
    same = query == key
    if spec.kind == "window":
        if low >= spec.size:
            return "skip"
        if low >= 0 and high < spec.size:
            return "full"
        return "causal" if same and qe - qs <= spec.size else "masked"
    if spec.kind == "chunk":
        c = spec.size
        if (qe - 1) // c < ks // c or (ke - 1) // c < qs // c:
            return "skip"
        if not (qs // c == (qe - 1) // c == ks // c == (ke - 1) // c):
            return "masked"
    if low >= 0:
        return "full"
    return "causal" if same else "masked"


class Piece(NamedTuple):
    """One kernel call: queries ``[qs, qe)`` and keys ``[ks, ke)`` (indices into the call's query and key
    tensors), ``kind`` ``"full"`` / ``"causal"`` / ``"masked"``; ``q0`` / ``k0``: the sequence index of their
    first query and key."""

    qs: int
    qe: int
    ks: int
    ke: int
    kind: str
    q0: int
    k0: int


def plan_pieces(queries: Sequence[Range], keys: Sequence[Range], spec: MaskSpec, documents: bool = False,
                block: int = 1024) -> list[Piece]:
    """The kernel calls of attention from queries at the sequence ranges ``queries`` (laid out one after the other
    in the query tensor) to keys at ``keys`` (likewise in the key tensor) under ``spec`` (:func:`block_kind`):
    excluded pieces skipped, consecutive wholly allowed key ranges of one query range merged into one call; a piece
    that needs a mask is cut first where the structure changes (the query range's own start and end among the keys,
    chunk boundaries), then in blocks of at most ``block`` queries and keys, each again classified.
    ``documents``: every piece that is not skipped gets a mask (the documents are only known on the device), and
    chunks, which then follow each document's positions, skip nothing beyond causality. Pure.

    Example:
        >>> [p.kind for p in plan_pieces([(0, 2), (6, 8)], [(0, 8)], MaskSpec())]
        ['causal', 'full', 'causal']
        >>> [p.kind for p in plan_pieces([(0, 8)], [(0, 8)], MaskSpec("chunk", 4))]
        ['causal', 'causal']
    """
    if documents and spec.kind == "chunk":  # chunk edges move with each document: only causality is structural
        spec = MaskSpec("causal", documents=True)
    out: list[Piece] = []
    q_off = 0
    for qs, qe in queries:
        k_off = 0
        for ks, ke in keys:
            _split(out, (qs, qe), (ks, ke), q_off - qs, k_off - ks, spec, documents, block)
            k_off += ke - ks
        q_off += qe - qs
    return _merge_full(out)


def _cuts(start: int, end: int, points: Sequence[int]) -> list[Range]:
    inner = sorted({p for p in points if start < p < end})
    edges = [start, *inner, end]
    return list(zip(edges[:-1], edges[1:]))


def _split(out: list[Piece], query: Range, key: Range, q_shift: int, k_shift: int, spec: MaskSpec,
           documents: bool, block: int) -> None:
    kind = block_kind(spec, query, key)
    if kind == "skip":
        return
    (qs, qe), (ks, ke) = query, key
    if kind == "masked" or documents:
        # where the structure changes: the queries' own range among the keys, chunk boundaries
        k_points, q_points = [qs, qe], []
        if spec.kind == "chunk":
            c = spec.size
            k_points += range((ks // c + 1) * c, ke, c)
            q_points += range((qs // c + 1) * c, qe, c)
        parts = [(q, k) for q in _cuts(qs, qe, q_points) for k in _cuts(ks, ke, k_points)]
        if len(parts) == 1 and (qe - qs > block or ke - ks > block):  # then blocks, aligned on the queries
            parts = [(q, k) for q in _cuts(qs, qe, range(qs + block, qe, block))
                     for k in _cuts(ks, ke, range(qs + (ks - qs) // block * block, ke, block))]
        if len(parts) > 1:
            for q, k in parts:
                _split(out, q, k, q_shift, k_shift, spec, documents, block)
            return
        kind = "masked"
    out.append(Piece(qs + q_shift, qe + q_shift, ks + k_shift, ke + k_shift, kind, qs, ks))


def _merge_full(pieces: list[Piece]) -> list[Piece]:
    """Adjacent ``"full"`` pieces of the same queries and touching keys become one call."""
    merged: list[Piece] = []
    for p in pieces:
        last = merged[-1] if merged else None
        if (last is not None and p.kind == last.kind == "full" and (p.qs, p.qe) == (last.qs, last.qe)
                and p.ks == last.ke and p.k0 == last.k0 + (last.ke - last.ks)):
            merged[-1] = last._replace(ke=p.ke)
        else:
            merged.append(p)
    return merged
