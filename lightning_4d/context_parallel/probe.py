"""Read each attention call's mask from what the model passes to ``F.scaled_dot_product_attention`` on a whole
sequence (the set-up check, :mod:`.check`): its kind and size (:func:`~.masks.classify_mask`) from a run on one
sequence, whether it keeps packed documents apart (:func:`~.masks.classify_documents`) from a run on two documents,
a window's or chunk's size mapped back from the check's shrunk lengths to the declared one (:mod:`.lengths`).
Anything else — a prefix, a mask with holes or a top-k selection, one that differs between samples or heads, a
window no declared length accounts for — is refused naming the module.

Example:
    >>> import torch
    >>> rec = MaskRecord("attn", "module 'attn' (Attention)", torch.ones(1, 8, 8, dtype=torch.bool).tril())
    >>> layer_specs([rec])
    {'attn': (MaskSpec(kind='causal', size=0, documents=False),)}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_4d.core.batches import document_ids
from lightning_4d.context_parallel.attention import allowed_from
from lightning_4d.context_parallel.shard import UnsplittableAttention
from lightning_4d.context_parallel.lengths import Shrunk
from lightning_4d.context_parallel.masks import MaskSpec, classify_documents, classify_mask

__all__ = ["MaskRecord", "document_positions", "layer_specs", "read_mask"]


@dataclass
class MaskRecord:
    """One attention call of the whole-sequence run: the innermost running module's ``name`` (and ``where``, its
    label for messages) and the mask it applied, ``(B, T, T)`` boolean (``True``: attend)."""

    name: str
    where: str
    allowed: Tensor


def read_mask(attn_mask: Optional[Tensor], is_causal: bool, batch: int, seq_len: int, where: str) -> Tensor:
    """The mask one SDPA call applies on a whole sequence, ``(B, T, T)`` boolean: from ``attn_mask`` (boolean or
    additive, any broadcastable shape; a bias is refused, :func:`~.attention.allowed_from`) or ``is_causal``, the
    same for every head (else refused naming ``where``).

    Example:
        >>> read_mask(None, True, 1, 3, "attn")[0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    if attn_mask is None:
        full = torch.ones(seq_len, seq_len, dtype=torch.bool)
        return (full.tril() if is_causal else full).expand(batch, seq_len, seq_len)
    allowed = allowed_from(attn_mask, where)
    allowed = allowed.reshape(-1, *allowed.shape[-2:]) if allowed.dim() <= 3 else allowed
    if allowed.dim() == 4:  # (B, H, T, T): the same for every head
        if not bool((allowed == allowed[:, :1]).all()):
            raise UnsplittableAttention(
                f"{where}: its attention mask differs between heads; context parallelism recomputes one mask per "
                f"sample from global positions. Use cp=1 for this model.")
        allowed = allowed[:, 0]
    if is_causal:
        allowed = allowed & torch.ones(seq_len, seq_len, dtype=torch.bool, device=allowed.device).tril()
    return allowed.expand(batch, seq_len, seq_len).cpu()


def document_positions(batch: int, seq_len: int) -> Tensor:
    """``position_ids`` ``(B, T)`` of two packed documents, the second starting at an odd index past the middle
    (not on a zigzag chunk's edge), for the documents run.

    Example:
        >>> document_positions(1, 8).tolist()
        [[0, 1, 2, 3, 4, 0, 1, 2]]
    """
    first = seq_len // 2 + 1
    positions = torch.cat([torch.arange(first), torch.arange(seq_len - first)])
    return positions[None].expand(batch, seq_len)


def _spec(rec: MaskRecord) -> MaskSpec:
    if not bool((rec.allowed == rec.allowed[:1]).all()):
        raise UnsplittableAttention(
            f"{rec.where}: its attention mask differs between the samples of one batch of plain sequences (padding, a "
            f"mask from the token values?); context parallelism recomputes the mask from global positions and "
            f"documents only. Use cp=1 for this model.")
    spec = classify_mask(rec.allowed[0])
    if spec is None:
        raise UnsplittableAttention(
            f"{rec.where}: its attention mask on a whole sequence is none of those context parallelism knows "
            f"(causal, a sliding window, causal chunks, bidirectional; each optionally per packed document) — a "
            f"prefix, a mask with holes, a selection of keys? Context parallelism recomputes each layer's mask for "
            f"the whole sequence and cannot recompute this one. Use cp=1 for this model.")
    return spec


def _declared(spec: MaskSpec, lengths: Shrunk, where: str) -> MaskSpec:
    """``spec`` with its window / chunk mapped back from the check's shrunk length to the declared one."""
    if spec.kind not in ("window", "chunk"):
        return spec
    size = lengths.original(spec.size)
    if size is None:
        what = "sliding window" if spec.kind == "window" else "attention chunk"
        raise UnsplittableAttention(
            f"{where}: on the set-up check's sequence it applies a {what} of {spec.size} tokens, which is none of the "
            f"lengths the model declares (shrunk for the check: {lengths.values}), so context parallelism cannot tell "
            f"its size on a real sequence. Declare it as `sliding_window` / `attention_chunk_size` on the attention "
            f"module or its config, or use cp=1.")
    return MaskSpec(spec.kind, size, spec.documents)


def layer_specs(records: Sequence[MaskRecord], doc_records: Optional[Sequence[MaskRecord]] = None,
                positions: Optional[Tensor] = None, lengths: Optional[Shrunk] = None) -> dict[str, tuple[MaskSpec, ...]]:
    """Each module's calls' masks, in call order, from ``records`` (a run on one sequence) and ``doc_records`` (the
    same calls on packed documents, ``position_ids`` ``positions`` ``(B, T)``; ``None``: the model takes no
    positions, so it cannot tell documents apart), sizes mapped back through ``lengths`` (``None``: nothing shrunk).
    Pure apart from host reads of set-up tensors.

    Raises:
        UnsplittableAttention: a mask context parallelism does not know, naming the module (see the module doc).
    """
    if doc_records is not None and [r.name for r in doc_records] != [r.name for r in records]:
        raise UnsplittableAttention(
            f"context parallelism: the model makes different attention calls on packed documents "
            f"({[r.name for r in doc_records][:4]}) than on one sequence ({[r.name for r in records][:4]}), so each "
            f"call's mask cannot be read. Use cp=1 for this model.")
    out: dict[str, list[MaskSpec]] = {}
    for i, rec in enumerate(records):
        spec = _spec(rec)
        if doc_records is not None and positions is not None:
            documents = classify_documents(doc_records[i].allowed, spec, document_ids(positions), positions)
            if documents is None:
                raise UnsplittableAttention(
                    f"{rec.where}: on packed documents (position_ids restarting) its attention mask is neither "
                    f"{spec.describe()} within each document nor across them; context parallelism cannot recompute "
                    f"it for the whole sequence. Use cp=1 for this model.")
            spec = MaskSpec(spec.kind, spec.size, documents)
        out.setdefault(rec.name, []).append(_declared(spec, lengths or Shrunk(), rec.where))
    return {name: tuple(specs) for name, specs in out.items()}
