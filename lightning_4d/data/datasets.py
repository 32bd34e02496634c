"""Token datasets: windows of a token file (:class:`TokenWindowDataset`), synthetic batches
(:class:`SyntheticTokenDataset`) and masked chat samples (:class:`MaskedTokenDataset`), and the one way the
DataModules load them (``_loader``).

Example:
    >>> ds = SyntheticTokenDataset(vocab_size=32, seq_len=8, num_samples=4, kind="increment")
    >>> x, y = ds[0]
    >>> bool(((x + 1) % 32 == y).all())
    True
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_4d.data.tokens import TokenFile

__all__ = ["MaskedTokenDataset", "SyntheticTokenDataset", "TokenWindowDataset", "positions_after"]

PathLike = Union[str, "os.PathLike[str]"]
SyntheticKind = Literal["random", "increment", "repeat"]


class TokenWindowDataset(Dataset):
    """Fixed-length windows over a token stream, as ``(inputs, targets)`` pairs.

    Window ``i`` covers tokens ``[i*stride, i*stride + seq_len + 1)``; ``inputs`` are its first
    ``seq_len`` tokens and ``targets`` its last ``seq_len`` (shifted by one). With the default
    ``stride=seq_len`` windows do not overlap in their inputs.

    With ``doc_end`` (the id ending every document, e.g. the EOS a packed text stream puts after each one) the
    windows are exact packed samples, ``(inputs, targets, position_ids)`` triples: positions restart at 0 after
    each ``doc_end`` (a window starting inside a document starts at 0 too), and a ``doc_end`` token has no target
    (``ignore_index``: it does not predict the next document's first token), so
    :class:`~lightning_4d.models.CausalLM` keeps attention within each document.

    Args:
        tokens: a :class:`~lightning_4d.data.tokens.TokenFile` or any 1-D integer array.
        seq_len: tokens per sample.
        stride: distance between window starts (default ``seq_len``).
        doc_end: the id that ends a document; ``None``: plain ``(inputs, targets)`` windows.
        ignore_index: target of a ``doc_end`` token.

    Raises:
        ValueError: fewer than ``seq_len + 1`` tokens, or a non-positive length or stride.

    Example:
        >>> ds = TokenWindowDataset(np.arange(10), seq_len=4)
        >>> len(ds)
        2
        >>> x, y = ds[1]
        >>> x.tolist(), y.tolist()
        ([4, 5, 6, 7], [5, 6, 7, 8])
        >>> x, y, pos = TokenWindowDataset([7, 1, 2, 0, 7, 3, 0, 7, 4], seq_len=8, doc_end=0)[0]
        >>> y.tolist(), pos.tolist()
        ([1, 2, 0, -100, 3, 0, -100, 4], [0, 1, 2, 3, 0, 1, 2, 0])
    """

    def __init__(self, tokens: Union[TokenFile, np.ndarray, Sequence[int]], seq_len: int,
                 stride: Optional[int] = None, doc_end: Optional[int] = None, ignore_index: int = -100):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        stride = seq_len if stride is None else stride
        if stride <= 0:
            raise ValueError(f"stride must be positive, got {stride}")
        self.tokens = tokens if isinstance(tokens, TokenFile) else np.asarray(tokens)
        self.seq_len = seq_len
        self.stride = stride
        self.doc_end, self.ignore_index = doc_end, ignore_index
        n = len(self.tokens)
        if n < seq_len + 1:
            where = f" in {str(tokens.path)!r}" if isinstance(tokens, TokenFile) else ""
            raise ValueError(
                f"not enough tokens{where}: {n} tokens, but one window of seq_len={seq_len} needs {seq_len + 1}"
            )
        self._len = (n - seq_len - 1) // stride + 1

    def __len__(self) -> int:
        return self._len

    @override
    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} windows")
        start = index * self.stride
        window = torch.from_numpy(np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        if self.doc_end is None:
            return window[:-1], window[1:]
        inputs = window[:-1]  # (T,)
        ends = inputs == self.doc_end  # (T,) token t ends its document
        targets = window[1:].masked_fill(ends, self.ignore_index)  # (T,)
        return inputs, targets, positions_after(ends)


def positions_after(ends: torch.Tensor) -> torch.Tensor:
    """Position of each token in its document, ``(T,)``: 0 at the start and after every token where ``ends`` is
    true (the ``position_ids`` of packed documents, :mod:`lightning_4d.core.batches`).

    >>> positions_after(torch.tensor([False, False, True, False, True, False])).tolist()
    [0, 1, 2, 0, 1, 0]
    """
    idx = torch.arange(len(ends))  # (T,)
    starts = torch.cat([torch.ones(1, dtype=torch.bool), ends[:-1]])  # (T,) a document starts here
    return idx - torch.where(starts, idx, 0).cummax(0).values  # (T,)


class SyntheticTokenDataset(Dataset):
    """Deterministic synthetic token sequences as ``(inputs, targets)`` pairs.

    Sample ``i`` depends only on ``(seed, split, i)``, never on global RNG state.

    Args:
        num_samples: dataset length.
        seq_len: tokens per sample.
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        kind: ``"random"`` (uniform, nothing to learn beyond chance: loss ≈ ln(vocab_size)),
            ``"increment"`` (each token is the previous plus one modulo ``vocab_size``; a
            bigram model learns it), or ``"repeat"`` (a random motif of ``period`` tokens
            repeated; learnable by copying from ``period`` positions back).
        period: motif length for ``"repeat"``.
        seed: base seed.
        split: stream id so that train and validation sets differ.

    Example:
        >>> ds = SyntheticTokenDataset(4, seq_len=6, vocab_size=100, kind="repeat", period=3)
        >>> x, y = ds[0]
        >>> x[:3].tolist() == x[3:].tolist(), x[1:].tolist() == y[:-1].tolist()
        (True, True)
    """

    def __init__(
        self,
        num_samples: int,
        seq_len: int,
        vocab_size: int,
        kind: SyntheticKind = "random",
        period: int = 8,
        seed: int = 0,
        split: int = 0,
    ) -> None:
        if kind not in ("random", "increment", "repeat"):
            raise ValueError(f"kind must be 'random', 'increment' or 'repeat', got {kind!r}")
        if num_samples <= 0 or seq_len <= 0 or vocab_size <= 0 or period <= 0:
            raise ValueError("num_samples, seq_len, vocab_size and period must be positive")
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.kind = kind
        self.period = period
        self.seed = seed
        self.split = split

    def __len__(self) -> int:
        return self.num_samples

    @override
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, self.split, index])
        n = self.seq_len + 1
        if self.kind == "random":
            seq = rng.integers(0, self.vocab_size, size=n)
        elif self.kind == "increment":
            seq = (rng.integers(0, self.vocab_size) + np.arange(n)) % self.vocab_size
        else:
            seq = np.resize(rng.integers(0, self.vocab_size, size=self.period), n)
        window = torch.from_numpy(np.asarray(seq, dtype=np.int64))
        return window[:-1], window[1:]


class MaskedTokenDataset(Dataset):
    """Chat / instruction samples as ``(inputs, targets)`` pairs whose targets are ``ignore_index`` where the
    next token is not part of an answer (prompts, role headers, padding).

    ``pack=False`` (default): sample ``i`` is conversation ``i``: its first ``seq_len + 1`` tokens (longer ones
    are cut; :attr:`truncated` counts them), padded with ``pad_id`` (padding is never a target); inputs and
    targets are that row shifted by one. ``pack=True``: conversations are one stream cut into windows like
    :class:`TokenWindowDataset` (``seq_len`` apart); a window may hold the end of one conversation and the start
    of the next. Packed samples are exact: they are ``(inputs, targets, position_ids)`` triples whose positions
    restart at 0 where a conversation starts (as transformers' ``DataCollatorWithFlattening`` writes them; a window
    that starts inside a conversation starts at 0 too), so :class:`~lightning_4d.models.CausalLM` keeps attention
    within each conversation; the last token of a conversation has no target (``ignore_index``), it does not
    predict the first token of the next. The loss of a packed batch is then the token-weighted loss of its
    conversations run one by one.

    Args:
        tokens: the token stream (a :class:`~lightning_4d.data.tokens.TokenFile` or a 1-D array).
        mask: per token 1 if it belongs to an answer, else 0 (same length as ``tokens``).
        docs: conversation start offsets with the end appended (``len = conversations + 1``).
        seq_len: tokens per sample.
        pack: windows over the stream instead of one conversation per sample.
        pad_id: filler id of short rows.
        ignore_index: target of tokens that are not trained on.

    Example:
        >>> toks, mask = np.arange(10), np.array([0, 0, 1, 1, 0, 0, 0, 1, 1, 1])
        >>> ds = MaskedTokenDataset(toks, mask, docs=np.array([0, 4, 10]), seq_len=4)
        >>> [t.tolist() for t in ds[0]]
        [[0, 1, 2, 3], [-100, 2, 3, -100]]
        >>> [t.tolist() for t in ds[1]]
        [[4, 5, 6, 7], [-100, -100, 7, 8]]
        >>> ds.truncated, ds.num_targets()
        (1, 4)
        >>> x, y, pos = MaskedTokenDataset(toks, mask, docs=np.array([0, 4, 10]), seq_len=6, pack=True)[0]
        >>> y.tolist(), pos.tolist()  # token 3 ends conversation 0: no target
        ([-100, 2, 3, -100, -100, -100], [0, 1, 2, 3, 0, 1])
    """

    def __init__(
        self,
        tokens: Union[TokenFile, np.ndarray, Sequence[int]],
        mask: Union[np.ndarray, Sequence[int]],
        docs: Union[np.ndarray, Sequence[int]],
        seq_len: int,
        pack: bool = False,
        pad_id: int = 0,
        ignore_index: int = -100,
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.tokens = tokens if isinstance(tokens, TokenFile) else np.asarray(tokens)
        self.mask = np.asarray(mask) if not isinstance(mask, np.ndarray) else mask
        self.docs = np.asarray(docs, dtype=np.int64)
        if len(self.mask) != len(self.tokens):
            raise ValueError(f"mask has {len(self.mask)} entries for {len(self.tokens)} tokens")
        if len(self.docs) < 2 or int(self.docs[0]) != 0 or int(self.docs[-1]) != len(self.tokens):
            raise ValueError(f"docs must run from 0 to the number of tokens ({len(self.tokens)}) in at least two "
                             f"offsets, got {len(self.docs)} offsets")
        self.seq_len, self.pack, self.pad_id, self.ignore_index = seq_len, pack, int(pad_id), int(ignore_index)
        n = len(self.tokens)
        if pack:
            if n < seq_len + 1:
                raise ValueError(f"not enough tokens: {n} tokens, but one window of seq_len={seq_len} needs "
                                 f"{seq_len + 1}")
            self._len = (n - seq_len - 1) // seq_len + 1
        else:
            self._len = len(self.docs) - 1
        lengths = np.diff(self.docs)
        self.truncated = 0 if pack else int((lengths > seq_len + 1).sum())
        """Conversations longer than ``seq_len + 1`` tokens, cut (``pack=False``)."""

    def __len__(self) -> int:
        return self._len

    def _span(self, index: int) -> tuple[int, int]:
        if self.pack:
            start = index * self.seq_len
            return start, start + self.seq_len + 1
        start, end = int(self.docs[index]), int(self.docs[index + 1])
        return start, min(end, start + self.seq_len + 1)

    @override
    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples")
        start, end = self._span(index)
        row = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        keep = np.zeros(self.seq_len + 1, dtype=bool)
        row[: end - start] = np.asarray(self.tokens[start:end], dtype=np.int64)
        keep[: end - start] = np.asarray(self.mask[start:end]) != 0
        if not self.pack:
            targets = np.where(keep[1:], row[1:], self.ignore_index)
            return torch.from_numpy(row[:-1].copy()), torch.from_numpy(targets)
        index_in_stream = np.arange(start, end)  # (T + 1,)
        doc = np.searchsorted(self.docs, index_in_stream, side="right") - 1  # (T + 1,) conversation of each token
        keep[1:] &= doc[1:] == doc[:-1]  # a conversation's last token does not predict the next one's first
        targets = np.where(keep[1:], row[1:], self.ignore_index)
        # positions restart at 0 where a conversation starts (a window starting inside one: at the window's start)
        positions = index_in_stream - np.maximum(self.docs[doc], start)  # (T + 1,)
        return (torch.from_numpy(row[:-1].copy()), torch.from_numpy(targets),
                torch.from_numpy(positions[:-1].astype(np.int64)))

    def num_targets(self) -> int:
        """Targets that are trained on, over the whole dataset (what the loss averages over)."""
        return sum(int((self[i][1] != self.ignore_index).sum()) for i in range(len(self)))

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps travel to DataLoader worker processes as their files, not as copies of the data.
        state = self.__dict__.copy()
        for key in ("mask", "docs"):
            value = state[key]
            if isinstance(value, np.memmap) and value.filename is not None:
                state[key] = ("memmap", value.filename, value.dtype.str, value.shape, int(value.offset))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key in ("mask", "docs"):
            value = state[key]
            if isinstance(value, tuple) and value and value[0] == "memmap":
                _, filename, dtype, shape, offset = value
                state[key] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", shape=shape, offset=offset)
        self.__dict__.update(state)


def _pin(module: Any, pin_memory: Optional[bool]) -> bool:
    """``pin_memory`` as given, or (``None``) whether the Trainer the data module is attached to trains on CUDA
    (pinned host batches copy to the GPU without blocking the host)."""
    if pin_memory is not None:
        return bool(pin_memory)
    trainer = getattr(module, "trainer", None)
    return trainer is not None and trainer.strategy.root_device.type == "cuda"


def _loader(
    dataset: Dataset, batch_size: int, shuffle: bool, seed: int, num_workers: int, pin_memory: bool
) -> DataLoader:
    if len(dataset) < batch_size:  # type: ignore[arg-type]
        raise ValueError(
            f"dataset has {len(dataset)} samples, fewer than batch_size={batch_size}; "  # type: ignore[arg-type]
            "with drop_last=True it would yield no batch"
        )
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        drop_last=True,  # equal batch shapes on every step (pipeline micro-batching needs them)
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
