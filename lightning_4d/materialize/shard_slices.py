"""A rank's part of a tensor, from and to the user's (unsharded) layout, without communication.

:func:`local_slice` / :func:`write_full` take this rank's elements of a full user-layout tensor into a parameter of
the rewritten model (plain, DTensor with any shard placements incl. FSDP2's strided shards, tensor parallelism's row
permutations, experts stacked on dim 0 by the rewrite); :func:`read_local` puts them back. Pure layout math: each
sharded dimension's indices come from sharding an ``arange`` there, so no whole-tensor index is ever built and a
plain shard is a view. Used by :mod:`lightning_4d.materialize.local_shards` (initialisation of meta-built models) and the
streamed Hugging Face loader.

Example:
    >>> t = torch.zeros(2, 2); write_full(t, torch.ones(2, 2)); t.tolist()
    [[1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from lightning_4d.core.distributed import local_of  # re-exported: its owner is lightning_4d.core.distributed

__all__ = ["LocalChunk", "chunkable", "local_chunks", "local_of", "local_slice", "read_local", "shards_only", "write_full"]


def local_slice(target: Tensor, full: Tensor, perm: Optional[tuple[list[int], int]] = None) -> Tensor:
    """This rank's part of ``full`` (the user-layout value of ``target``): rows permuted as tensor parallelism
    permuted them, then sliced as ``target``'s DTensor placements slice it (no communication).

    Example:
        >>> local_slice(torch.zeros(2), torch.arange(2.0)).tolist()
        [0.0, 1.0]
    """
    from torch.distributed.tensor import distribute_tensor

    if not shards_only(target):  # e.g. Partial: torch slices it (the rare case; one copy per placement)
        perm_dim = perm[1] if perm is not None and full.dim() > perm[1] and full.shape[perm[1]] == len(perm[0]) \
            else None
        if perm_dim is not None:
            full = full.index_select(perm_dim, torch.tensor(perm[0], device=full.device))
        return distribute_tensor(full, target.device_mesh, list(target.placements), src_data_rank=None).to_local()
    return _select(full, _selections(target, full.shape, perm, full.device))


def _select(full: Tensor, selections: list[tuple[int, Tensor]]) -> Tensor:
    """``full`` restricted to ``selections`` in turn; a contiguous block (a plain shard) is a view, not a copy."""
    local = full
    for dim, index in selections:
        start = int(index[0]) if index.numel() else 0
        if index.numel() and int(index[-1]) - start + 1 == index.numel() and bool((index.diff() == 1).all()):
            local = local.narrow(dim, start, index.numel())
        else:
            local = local.index_select(dim, index)
    return local


def _stacked_row(target: Tensor, perm: Optional[tuple[list[int], int]], index: int, full_shape: Sequence[int],
                 device: torch.device) -> Optional[tuple[Optional[int], list[tuple[int, Tensor]]]]:
    """Where slice ``index`` of a stacked tensor (experts stacked on dim 0 by the rewrite) lives in this rank's
    local tensor, from per-dimension indices (never a whole-tensor index): ``(local row or None when another
    rank holds it, the selections of the slice's own dimensions)``; ``None`` when the placements are not plain
    shards (then :func:`_positions` is used)."""
    if not shards_only(target) or tuple(full_shape) != tuple(target.shape[1:]):
        return None
    selections = _selections(target, tuple(target.shape), perm, device)
    rows = dict(selections).get(0)
    if rows is None:
        row: Optional[int] = index
    else:
        hits = (rows == index).nonzero()
        row = int(hits[0, 0]) if hits.numel() else None
    return row, [(dim - 1, idx) for dim, idx in selections if dim != 0]


def _selections(target: Tensor, shape: Sequence[int], perm: Optional[tuple[list[int], int]],
                device: torch.device) -> list[tuple[int, Tensor]]:
    """This rank's indices along each dimension its placements shard (and the TP row permutation), as
    ``[(dim, index)]``: the local part of a full tensor of ``shape`` is ``full.index_select(dim, index)`` in turn.
    Shards (plain or strided) select along their tensor dimension independently per dimension; each dimension's
    indices come from sharding an ``arange`` there (never a whole-tensor temporary)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    ndim = len(shape)
    perm_dim = perm[1] if perm is not None and ndim > perm[1] and shape[perm[1]] == len(perm[0]) else None
    placements = list(target.placements) if isinstance(target, DTensor) else []
    select: dict[int, Tensor] = {}
    for dim in sorted({p.dim % ndim for p in placements if not p.is_replicate()}):
        probe_shape = [1] * ndim
        probe_shape[dim] = shape[dim]
        probe = torch.arange(shape[dim], device=device).view(probe_shape)
        only = [p if not p.is_replicate() and p.dim % ndim == dim else Replicate() for p in placements]
        select[dim] = distribute_tensor(probe, target.device_mesh, only, src_data_rank=None).to_local().reshape(-1)
    if perm_dim is not None:  # tensor parallelism's row permutation, composed into the selection
        order = torch.tensor(perm[0], device=device)
        select[perm_dim] = order[select[perm_dim]] if perm_dim in select else order
    out = []
    for dim, index in sorted(select.items(), key=lambda item: item[1].numel() / max(shape[item[0]], 1)):
        if index.numel() == shape[dim] and bool((index == torch.arange(index.numel(), device=index.device)).all()):
            continue  # the whole dimension, in order
        out.append((dim, index.to(device)))
    return out


def shards_only(target: Tensor) -> bool:
    """Whether every placement of ``target`` is a (plain or strided) shard or a replica (no ``Partial``).

    Example:
        >>> shards_only(torch.ones(2))
        True
    """
    from torch.distributed.tensor import DTensor

    placements = list(target.placements) if isinstance(target, DTensor) else []
    return all(p.is_replicate() or getattr(p, "dim", None) is not None for p in placements)


def _positions(target: Tensor, perm: Optional[tuple[list[int], int]]) -> Tensor:
    """Flat user-layout index of each of this rank's elements of ``target`` (local order)."""
    shape = tuple(target.shape)
    numel = 1
    for s in shape:
        numel *= s
    dtype = torch.int32 if numel < 2**31 else torch.int64
    return local_slice(target, torch.arange(numel, dtype=dtype).view(shape), perm).reshape(-1).long()


def _scatter(full: Tensor, selections: list[tuple[int, Tensor]], local: Tensor) -> None:
    """``full`` restricted to ``selections`` (applied in order, as :func:`local_slice` does) := ``local``."""
    if not selections:
        full.copy_(local)
        return
    (dim, index), rest = selections[0], selections[1:]
    if not rest:
        full.index_copy_(dim, index, local)
        return
    part = full.index_select(dim, index)  # this rank's rows along ``dim``, whole along the others
    _scatter(part, rest, local)
    full.index_copy_(dim, index, part)


@torch.no_grad()
def read_local(target: Tensor, full: Tensor, perm: Optional[tuple[list[int], int]] = None,
               index: Optional[int] = None) -> None:
    """The inverse of :func:`write_full` for this rank's elements: put ``target``'s local values into ``full``
    at their user-layout positions (other elements untouched).

    Example:
        >>> full = torch.zeros(2); read_local(torch.ones(2), full); full.tolist()
        [1.0, 1.0]
    """
    if full.dim() == 0:
        full.copy_(local_of(target).reshape(()))
        return
    if index is None and shards_only(target):
        # Per-dimension indices (local-sized), never a whole-tensor index: scatter back one dimension at a time.
        local = local_of(target).to(full.device, full.dtype)
        selections = _selections(target, full.shape, perm, full.device)
        expected = list(full.shape)
        for dim, idx in selections:
            expected[dim] = idx.numel()
        _scatter(full, selections, local.reshape(expected))
        return
    stacked = _stacked_row(target, perm, index, full.shape, full.device) if index is not None else None
    if stacked is not None:
        row, rest = stacked
        if row is not None:
            expected = list(full.shape)
            for dim, idx in rest:
                expected[dim] = idx.numel()
            _scatter(full, rest, local_of(target)[row].to(full.device, full.dtype).reshape(expected))
        return
    local = local_of(target).reshape(-1)
    positions = _positions(target, perm)
    if index is not None:
        per = full.numel()
        mask = (positions >= index * per) & (positions < (index + 1) * per)
        positions, local = positions[mask] - index * per, local[mask.to(local.device)]
    full.view(-1)[positions.to(full.device)] = local.to(full.device, full.dtype)


@torch.no_grad()
def write_full(target: Tensor, full: Tensor, perm: Optional[tuple[list[int], int]] = None,
               index: Optional[int] = None) -> None:
    """Write this rank's part of the user-layout value ``full`` into ``target`` (a parameter or buffer of the
    rewritten model: plain, DTensor, FSDP2 shard). ``index``: ``full`` is slice ``index`` of ``target``'s dim 0
    (experts stacked by the rewrite).

    Example:
        >>> t = torch.zeros(2, 2); write_full(t, torch.ones(2), index=1); t.tolist()
        [[0.0, 0.0], [1.0, 1.0]]
    """
    local = local_of(target)
    if index is None:
        part = local_slice(target, full.to(local.device, local.dtype), perm)
        local.copy_(part if part.shape == local.shape else part.reshape(local.shape))
        return
    stacked = _stacked_row(target, perm, index, full.shape, local.device)
    if stacked is not None:  # this rank's row of the stack (if any), sliced along the slice's own dimensions
        row, rest = stacked
        if row is not None:
            part = _select(full.to(local.device, local.dtype), rest)
            local[row].copy_(part if part.shape == local[row].shape else part.reshape(local[row].shape))
        return
    # Other placements (e.g. Partial): find which of this rank's elements come from row ``index``.
    per = full.numel()
    positions = _positions(target, perm)
    mask = (positions >= index * per) & (positions < (index + 1) * per)
    if bool(mask.any()):
        flat = local.view(-1)
        flat[mask.to(flat.device)] = full.reshape(-1).to(local.device, local.dtype)[positions[mask] - index * per]



class LocalChunk(NamedTuple):
    """Elements ``[start, stop)`` (row-major) of ``dest`` — this rank's local tensor, or its row of a stacked
    one — and their flat ``positions`` in the user-layout tensor (see :func:`local_chunks`)."""

    dest: Tensor
    start: int
    stop: int
    positions: Tensor

    def get(self) -> Tensor:
        """The chunk's current values (1-D)."""
        if self.dest.is_contiguous():
            return self.dest.view(-1)[self.start:self.stop]
        return self.dest.reshape(-1)[self.start:self.stop]

    def put(self, values: Tensor) -> None:
        """Write the chunk's values (1-D, in order)."""
        values = values.to(self.dest.device, self.dest.dtype)
        if self.dest.is_contiguous():
            self.dest.view(-1)[self.start:self.stop] = values
            return
        index = torch.arange(self.start, self.stop)
        coords = []
        for size in reversed(self.dest.shape):
            coords.append(index % size)
            index = index // size
        self.dest[tuple(reversed(coords))] = values


def chunkable(target: Tensor, index: Optional[int]) -> bool:
    """Whether :func:`local_chunks` can enumerate ``target``'s elements (everything but a stacked slice of a
    tensor with non-shard placements).

    Example:
        >>> chunkable(torch.zeros(2), None)
        True
    """
    return index is None or shards_only(target)


def local_chunks(target: Tensor, shape: Sequence[int], perm: Optional[tuple[list[int], int]] = None,
                 index: Optional[int] = None, chunk: int = 1 << 20) -> Iterator[LocalChunk]:
    """This rank's elements of ``target`` (the rewritten parameter holding the user-layout tensor of ``shape``;
    ``index``: slice ``index`` of ``target``'s dim 0, experts stacked by the rewrite), at most ``chunk`` at a time,
    each with its flat position in the user-layout tensor: what a rank computes to initialise exactly its share.
    Positions come from the per-dimension selections (never a whole-tensor index) unless the placements are not
    plain shards (``Partial``: the rare case; with ``index`` a ``ValueError``, see :func:`chunkable`).

    Example:
        >>> [c.positions.tolist() for c in local_chunks(torch.zeros(2, 2), (2, 2), chunk=3)]
        [[0, 1], [2, 3]]
    """
    local = local_of(target)
    shape = tuple(shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    selections: Optional[list[tuple[int, Tensor]]] = None
    dest = local
    if index is None and shards_only(target):
        selections = _selections(target, shape, perm, torch.device("cpu"))
    elif index is not None:
        stacked = _stacked_row(target, perm, index, shape, torch.device("cpu"))
        if stacked is not None:
            row, selections = stacked
            if row is None:
                return
            dest = local[row]
    if selections is None:
        if index is not None:
            raise ValueError("a stacked tensor with placements other than shards: use write_full on the slice")
        positions = _positions(target, perm)  # other placements (Partial): every local element's position
        for start in range(0, positions.numel(), chunk):
            yield LocalChunk(local, start, min(start + chunk, positions.numel()), positions[start:start + chunk])
        return
    maps = dict(selections)
    sizes = [maps[d].numel() if d in maps else shape[d] for d in range(len(shape))]
    total = 1
    for s in sizes:
        total *= s
    if total != dest.numel():
        raise ValueError(f"local tensor of {dest.numel()} elements, selections give {total}")
    yield from _chunks_of(dest, sizes, [(maps[d] if d in maps else torch.arange(sizes[d])) * strides[d]
                                        for d in range(len(shape))], chunk)


def _chunks_of(dest: Tensor, sizes: list[int], contrib: list[Tensor], chunk: int) -> Iterator[LocalChunk]:
    """Chunks of whole trailing blocks: the positions of the trailing dimensions that fit in ``chunk`` are one
    outer sum of their per-dimension offsets ``contrib`` (computed once); a chunk adds the leading rows' offsets to
    it (a last dimension longer than ``chunk`` is cut into pieces). No per-element division."""
    n = len(sizes)
    if n == 0:
        yield LocalChunk(dest, 0, 1, torch.zeros(1, dtype=torch.long))
        return
    k, inner = n, 1
    while k > 0 and inner * sizes[k - 1] <= chunk:
        k -= 1
        inner *= sizes[k]
    lead_sizes = sizes[:k] if k < n else sizes[:-1]

    def lead_offsets(rows: Tensor) -> Tensor:  # (R,) flat indices over the leading dims -> their offsets
        out = torch.zeros_like(rows)
        for d in range(len(lead_sizes) - 1, -1, -1):
            out += contrib[d][rows % lead_sizes[d]]
            rows = rows // lead_sizes[d]
        return out

    n_rows = 1
    for size in lead_sizes:
        n_rows *= size
    if k == n:  # even the last dimension exceeds the chunk: pieces of it, row by row
        last = sizes[-1]
        for row in range(n_rows):
            base = int(lead_offsets(torch.tensor([row]))[0])
            for a in range(0, last, chunk):
                b = min(a + chunk, last)
                yield LocalChunk(dest, row * last + a, row * last + b, base + contrib[-1][a:b])
        return
    block = torch.zeros(1, dtype=torch.long)
    for d in range(k, n):
        block = (block[:, None] + contrib[d][None, :]).reshape(-1)  # (inner,)
    per_chunk = max(1, chunk // inner)
    for first in range(0, n_rows, per_chunk):
        last = min(first + per_chunk, n_rows)
        positions = (lead_offsets(torch.arange(first, last))[:, None] + block[None, :]).reshape(-1)
        yield LocalChunk(dest, first * inner, last * inner, positions)
