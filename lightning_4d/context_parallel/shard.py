"""This rank's share of one batch's sequence and what attention needs to stay exact across the cp ranks.

Example:
    >>> SequenceShard(None, cp=2, rank=1, seq_len=8).ranges()
    [(2, 4), (4, 6)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_4d.core.batches import document_ids
from lightning_4d.context_parallel.collectives import gather_sequence
from lightning_4d.context_parallel.masks import MaskSpec
from lightning_4d.context_parallel.zigzag import restore_order, zigzag_indices, zigzag_ranges

__all__ = ["SequenceShard", "UnsplittableAttention"]


class UnsplittableAttention(ValueError):
    """An attention call context parallelism cannot split exactly (named in the message)."""


@dataclass
class SequenceShard:
    """This rank's share of one batch's sequence and what attention needs to stay exact.

    Attributes:
        group: the context-parallel process group (``cp`` ranks, this one at ``rank``).
        seq_len: the global sequence length ``T``.
        global_docs: document ids ``(B, T)`` of packed documents (from the global ``position_ids``), else ``None``.
        global_positions: those ``position_ids`` ``(B or 1, T)`` (chunks follow them within a document), else
            ``None``.
        local_docs: document ids ``(1 or B, T/cp)`` the model sees in its local ``position_ids`` (``None``: the model
            is not given positions): the mask it builds from them is what a call without the set-up check's masks
            accepts.
        per_microbatch: packed documents under pipeline parallelism: the documents are those of each micro-batch,
            learnt when it enters the model (:meth:`for_microbatch`, :func:`bind_microbatches`), not of the batch.

    Example:
        >>> shard = SequenceShard(None, cp=2, rank=1, seq_len=8)
        >>> shard.query_pos.tolist(), shard.ranges()
        ([2, 3, 4, 5], [(2, 4), (4, 6)])
    """

    group: Optional[dist.ProcessGroup]
    cp: int
    rank: int
    seq_len: int
    global_docs: Optional[Tensor] = None
    local_docs: Optional[Tensor] = None
    per_microbatch: bool = False
    global_positions: Optional[Tensor] = None
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
                             local_docs=document_ids(local_positions), global_positions=positions)

    @property
    def query_pos(self) -> Tensor:
        """Global positions ``(T/cp,)`` of this rank's tokens (zigzag)."""
        return zigzag_indices(self.seq_len, self.cp, self.rank)

    def ranges(self, rank: Optional[int] = None) -> list[tuple[int, int]]:
        """The sequence ranges ``[start, end)`` of ``rank``'s tokens (default: this rank's), in the order it holds
        them."""
        return zigzag_ranges(self.seq_len, self.cp, self.rank if rank is None else rank)

    def documents(self, spec: MaskSpec) -> Optional[Tensor]:
        """The document ids ``(B, T)`` a call with mask ``spec`` keeps apart: the batch's packed documents when the
        call separates documents, else ``None``."""
        return self.global_docs if spec.documents else None

    def positions(self, spec: MaskSpec) -> Optional[Tensor]:
        """The ``position_ids`` ``(B or 1, T)`` a call with mask ``spec`` takes its chunks from (packed documents),
        else ``None``."""
        return self.global_positions if spec.documents and self.global_docs is not None else None

    def global_mask(self, spec: MaskSpec, device: torch.device) -> Tensor:
        """``(1 or B, 1, T/cp, T)``: ``spec`` from this rank's queries to the whole sequence; cached. Only for
        attention dropout, which the pieces cannot replay (:class:`ContextParallelAttention`)."""
        key = f"global-{spec}-{device}"
        if key not in self._masks:
            q, k = self.query_pos.to(device), torch.arange(self.seq_len, device=device)
            docs, pos = self.documents(spec), self.positions(spec)
            docs = docs.to(device) if docs is not None else None
            pos = pos.to(device) if pos is not None else None
            self._masks[key] = spec.allowed(q, k, None if docs is None else docs[:, q], docs,
                                            None if pos is None else pos[:, q], pos)
        return self._masks[key]

    def local_masks(self, device: torch.device) -> list[tuple[bool, Tensor]]:
        """The masks a model may build from its local chunk, ``(1 or B, 1, T/cp, T/cp)``, each with whether it
        separates documents: causal within the local documents (when it is given positions), plain causal."""
        key = f"local-{device}"
        if key not in self._masks:
            idx = torch.arange(self.seq_len // self.cp, device=device)
            self._masks[key] = MaskSpec().allowed(idx, idx)  # (1, 1, T/cp, T/cp)
        masks = []
        if self.local_docs is not None:
            docs = self.local_docs.to(device)
            masks.append((True, self._masks[key] & (docs[:, :, None] == docs[:, None, :])[:, None]))
        return masks + [(False, self._masks[key])]
