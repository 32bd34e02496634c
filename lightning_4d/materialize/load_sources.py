"""Pretrained weights read into this rank's shards: only the pieces a rank keeps, never a whole tensor it does not.

A module of a meta-built model may carry a :class:`~lightning_4d.analysis.hooks.WeightSource` (``fourd_weight_source``, e.g.
a Hugging Face directory). :func:`load_sources` overwrites the initialised values of the tensors it names:

- a tensor of which this rank holds nothing (another stage's, another rank's expert) is not read at all;
- when the source can read rows (``get_rows(name, start, stop)``: rows of dim 0, i.e. experts of a stacked expert
  tensor, rows of an embedding), a rank reads only the rows its elements lie in, a piece at a time: the rows one
  chunk of its local elements spans (at least one row: one expert), and copies its elements out;
- otherwise (a source with ``get`` only) the whole tensor is read, this rank's part kept, the rest freed.

The positions of a rank's elements come from :func:`~lightning_4d.materialize.shard_slices.local_chunks`, the same walk the
initialisation uses, so every placement (TP shards, fused-projection permutations, EP-stacked experts) reads
exactly what it keeps.

Example:
    >>> import torch
    >>> class Rows:
    ...     def names(self): return ["weight"]
    ...     def get(self, name): return torch.arange(6.).view(3, 2)
    ...     def get_rows(self, name, start, stop): return self.get(name)[start:stop]
    >>> reader = RowReader(Rows(), "weight", (3, 2), torch.float32)
    >>> reader.values(torch.tensor([1, 4])).tolist()
    [1.0, 4.0]
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_4d.analysis.hooks import WEIGHT_SOURCE, WeightSource, weight_source
from lightning_4d.materialize.init_pieces import CHUNK_ELEMENTS
from lightning_4d.materialize.shard_slices import chunkable, local_chunks

__all__ = ["RowReader", "load_sources", "weight_sources"]

Place = tuple[Tensor, Optional[tuple[list[int], int]], Optional[int]]  # (target, TP row permutation, stack index)


def weight_sources(skeleton: nn.Module) -> Iterator[tuple[str, WeightSource]]:
    """``(name prefix, source)`` of every ``fourd_weight_source`` in ``skeleton``.

    Example:
        >>> list(weight_sources(nn.Linear(2, 2)))
        []
    """
    for prefix, mod in skeleton.named_modules():
        source = weight_source(mod)
        if source is None:
            continue
        if not isinstance(source, WeightSource):
            raise TypeError(f"{prefix or type(mod).__name__}.{WEIGHT_SOURCE} must have names() and get(name); "
                            f"got {type(source).__name__}.")
        yield (f"{prefix}." if prefix else ""), source


class RowReader:
    """Values of model tensor ``name`` (``shape``) at flat positions, read from ``source`` as the dim-0 rows
    holding them (the last block kept while later positions fall in it: an expert larger than a chunk is read
    once). ``reads`` counts ``get_rows`` calls, ``peak_elements`` the largest block held: the rows one chunk of
    :data:`~lightning_4d.materialize.init_pieces.CHUNK_ELEMENTS` local elements spans, at least one row (one expert).

    Example:
        >>> import torch
        >>> class Rows:
        ...     def get_rows(self, name, start, stop): return torch.arange(6.).view(3, 2)[start:stop]
        >>> r = RowReader(Rows(), "w", (3, 2), torch.float32)
        >>> r.values(torch.tensor([5])).tolist(), r.peak_elements
        ([5.0], 2)
    """

    def __init__(self, source: WeightSource, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.source, self.name, self.dtype = source, name, dtype
        self.shape = tuple(shape)
        self.row = 1
        for size in self.shape[1:]:
            self.row *= size
        self.reads = 0
        self.peak_elements = 0
        self._block: Optional[Tensor] = None  # (rows, row) of the rows [_start, _start + len)
        self._start = 0

    def values(self, positions: Tensor) -> Tensor:
        """The tensor's values at flat ``positions`` (1-D int64, ascending within a row block), in order."""
        rows = positions // self.row
        first, last = int(rows.min()), int(rows.max())
        if self._block is None or first < self._start or last >= self._start + self._block.shape[0]:
            stop = last + 1  # exactly the rows holding these elements: never another rank's expert
            self._block = None  # free the previous block before reading the next
            piece = self.source.get_rows(self.name, first, stop)  # type: ignore[attr-defined]
            if tuple(piece.shape) != (stop - first, *self.shape[1:]):
                raise ValueError(f"{self.name}: get_rows({first}, {stop}) gave shape {tuple(piece.shape)}, expected "
                                 f"{(stop - first, *self.shape[1:])}.")
            self._block = piece.reshape(stop - first, self.row)
            self._start = first
            self.reads += 1
            self.peak_elements = max(self.peak_elements, self._block.numel())
        return self._block.view(-1)[positions - self._start * self.row].to(self.dtype)


def load_sources(skeleton: nn.Module, by_name: dict[str, object], places: Callable[[object], list[Place]],
                 write: Callable[[object, Tensor], None], meta_of: Callable[[object], Tensor],
                 mark_written: Callable[[object], None]) -> tuple[int, int]:
    """Overwrite the initialised values of every tensor a ``fourd_weight_source`` of ``skeleton`` names with the
    pretrained ones, reading only what this rank keeps (see the module docstring). ``by_name``: skeleton tensor
    name → the materialiser's entry; ``places(entry)``: where its values go on this rank (nothing: not read);
    ``write(entry, full)``: the whole-tensor path; ``meta_of(entry)``: its meta tensor (shape, dtype).
    Returns ``(tensors read, tensors read in row pieces)``.

    Raises:
        ValueError: a source's tensor has another shape than the model's.

    Example:
        >>> load_sources(nn.Linear(2, 2), {}, lambda e: [], lambda e, t: None, lambda e: None, lambda e: None)
        (0, 0)
    """
    loaded = pieces = 0
    for pre, source in weight_sources(skeleton):
        done: set[int] = set()
        rows = getattr(source, "get_rows", None)
        for rel in source.names():
            entry = by_name.get(pre + rel)
            if entry is None or id(entry) in done:
                continue
            done.add(id(entry))
            where = places(entry)
            mark_written(entry)
            if not where:
                continue  # nothing of it lives here: nothing to read
            meta = meta_of(entry)
            shape = tuple(meta.shape)
            if callable(rows) and len(shape) >= 1 and all(chunkable(t, i) for t, _, i in where):
                reader = RowReader(source, rel, shape, meta.dtype)
                for target, perm, index in where:
                    for chunk in local_chunks(target, shape, perm, index, CHUNK_ELEMENTS):
                        chunk.put(reader.values(chunk.positions))
                del reader
                release = getattr(source, "release", None)
                if callable(release):
                    release()  # whatever the source kept for this tensor's pieces
                pieces += 1
            else:
                full = source.get(rel)
                if tuple(full.shape) != shape:
                    raise ValueError(f"{pre + rel}: the pretrained weights hold shape {tuple(full.shape)}, the model "
                                     f"expects {shape}. Is the directory another model's?")
                write(entry, full)
                del full
            loaded += 1
    return loaded, pieces
