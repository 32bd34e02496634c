"""Zigzag load balancing of a sequence over ``cp`` ranks: pure index math, no process group.

The sequence of length ``T`` is cut into ``2·cp`` equal chunks; rank ``r`` holds chunk ``r`` and chunk
``2·cp - 1 - r`` (a head and a tail chunk), so under a causal mask every rank attends to the same number of
(query, key) pairs. All ranks' chunks, concatenated in rank order, are a permutation of ``0..T-1``
(:func:`gathered_order`); :func:`restore_order` is its inverse.

Example:
    >>> zigzag_indices(8, cp=2, rank=0).tolist(), zigzag_indices(8, cp=2, rank=1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_sequence_length", "gathered_order", "restore_order", "zigzag_indices", "zigzag_ranges",
           "zigzag_split"]


def check_sequence_length(seq_len: int, cp: int, tp: int = 1) -> None:
    """Refuse a sequence length zigzag sharding cannot split evenly: ``2·cp`` equal chunks, and with sequence
    parallelism (``tp > 1``) each rank's ``T / cp`` tokens split again over ``tp``.

    Example:
        >>> check_sequence_length(16, cp=2, tp=2)
        >>> check_sequence_length(10, cp=2)
        Traceback (most recent call last):
        ...
        ValueError: sequence length 10 is not divisible by 2·cp = 4: ...
    """
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2·cp = {2 * cp}: context parallelism cuts every sequence "
            f"in 2·cp equal chunks (each rank a head and a tail chunk). Pad or pack the sequences to a multiple of "
            f"{2 * cp}.")
    if tp > 1 and (seq_len // cp) % tp:
        raise ValueError(
            f"sequence length {seq_len}: each context-parallel rank holds {seq_len // cp} tokens, not divisible by "
            f"tp={tp} (sequence parallelism splits them again). Pad the sequences to a multiple of {2 * cp * tp}.")


def zigzag_indices(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> Tensor:
    """Global positions ``(T / cp,)`` of the tokens rank ``rank`` holds: chunk ``rank`` then chunk
    ``2·cp - 1 - rank`` of ``2·cp``.

    Example:
        >>> zigzag_indices(12, cp=3, rank=1).tolist()
        [2, 3, 8, 9]
    """
    check_sequence_length(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is outside the {cp} context-parallel ranks.")
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail_start = (2 * cp - 1 - rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])  # (T/cp,)


def zigzag_ranges(seq_len: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The two sequence ranges ``[start, end)`` rank ``rank`` holds, in its order: chunk ``rank``, then chunk
    ``2·cp - 1 - rank`` (:func:`zigzag_indices` as ranges).

    Example:
        >>> zigzag_ranges(12, cp=3, rank=1)
        [(2, 4), (8, 10)]
    """
    chunk = seq_len // (2 * cp)
    tail = 2 * cp - 1 - rank
    return [(rank * chunk, (rank + 1) * chunk), (tail * chunk, (tail + 1) * chunk)]


def zigzag_split(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's zigzag share of ``x`` along ``dim`` (the sequence dimension).

    Example:
        >>> zigzag_split(torch.arange(8)[None], cp=2, rank=1).tolist()
        [[2, 3, 4, 5]]
    """
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp, rank, device=x.device))


def gathered_order(seq_len: int, cp: int, device: torch.device | str | None = None) -> Tensor:
    """Global positions ``(T,)`` of the tokens of all ranks gathered in rank order (what an all-gather along the
    sequence returns).

    Example:
        >>> gathered_order(8, cp=2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    return torch.cat([zigzag_indices(seq_len, cp, r, device=device) for r in range(cp)])


def restore_order(seq_len: int, cp: int, device: torch.device | str | None = None) -> Tensor:
    """The permutation putting gathered tokens back in sequence order: ``gathered[restore_order] == arange(T)``.

    Example:
        >>> restore_order(8, cp=2).tolist()
        [0, 1, 4, 5, 6, 7, 2, 3]
        >>> bool((gathered_order(8, 2)[restore_order(8, 2)] == torch.arange(8)).all())
        True
    """
    return torch.argsort(gathered_order(seq_len, cp, device=device))
