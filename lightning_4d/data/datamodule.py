"""Datasets and Lightning DataModules that yield ``(inputs, targets)`` token batches.

Batches are pairs of ``LongTensor`` of shape ``(batch_size, seq_len)`` where ``targets`` is
``inputs`` shifted left by one token. ``batch_size`` is per data-parallel rank: the data
loaders here are plain ``DataLoader`` objects and Lightning replaces their sampler with a
``DistributedSampler`` keyed on the strategy's data-parallel rank (``use_distributed_sampler=True``,
the default), so tensor- and pipeline-parallel peers receive the same batch.

Example:
    >>> dm = SyntheticDataModule(vocab_size=32, seq_len=8, batch_size=2, kind="increment")
    >>> dm.setup("fit")
    >>> x, y = next(iter(dm.train_dataloader()))
    >>> x.shape, bool(((x + 1) % 32 == y).all())
    (torch.Size([2, 8]), True)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_4d.data.tokenizer import (
    Tokenizer,
    get_tokenizer,
    is_tokenizer_dir,
    tokenizer_difference,
    tokenizer_record,
)
from lightning_4d.data.tokens import TokenFile, prepare, source_record

if TYPE_CHECKING:
    from lightning_4d.data.prepared import DatasetPrepareResult

__all__ = [
    "HFDataModule",
    "MaskedTokenDataset",
    "SyntheticDataModule",
    "SyntheticTokenDataset",
    "TextDataModule",
    "TokenWindowDataset",
]

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


def _pin(module: L.LightningDataModule, pin_memory: Optional[bool]) -> bool:
    """``pin_memory`` as given, or (``None``) whether the Trainer the module is attached to trains on CUDA (pinned
    host batches copy to the GPU without blocking the host)."""
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


class TextDataModule(L.LightningDataModule):
    """Language-model batches from memory-mapped token files (``train.bin`` / ``val.bin``).

    ``prepare_data`` (run by Lightning on one process per node) tokenizes the text into
    ``data_dir`` once; files are written atomically, so concurrent nodes sharing a file system
    are safe. Existing files are reused unless they were built from a different ``text``,
    ``max_bytes``, ``val_fraction`` or tokenizer. If ``text`` is ``None`` and ``data_dir``
    already holds files prepared from user text (e.g. with ``python -m lightning_4d.data
    prepare``), they are used as they are; otherwise the standard library's ``.py`` sources
    are the corpus.

    Args:
        data_dir: directory of the token files.
        text: text file(s) or directories to tokenize; ``None`` for the default corpus.
        seq_len: tokens per sample.
        batch_size: samples per batch **per data-parallel rank**.
        num_workers: DataLoader worker processes.
        tokenizer: ``"byte"``, a tiktoken name such as ``"gpt2"``, or a local directory holding a Hugging
            Face tokenizer (the model's own, loaded offline).
        max_bytes: cap on raw text bytes (default: 4 MB for the default corpus, none for user text).
        val_fraction: share of tokens held out for validation.
        seed: seed of the training shuffle.
        stride: distance between training window starts (default ``seq_len``: no overlap).
        pin_memory: passed to the DataLoaders; ``None``: pinned when the Trainer trains on CUDA.
        pack: exact packing: samples are ``(inputs, targets, position_ids)`` whose positions restart after each
            file's end-of-text id, so attention stays within a document (:class:`TokenWindowDataset` ``doc_end``);
            needs a tokenizer with an end-of-text id (tiktoken, Hugging Face; not ``byte``).

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> dm = TextDataModule(tmp.name, seq_len=16, batch_size=2, max_bytes=20_000)
        >>> dm.prepare_data(); dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> x.shape, dm.vocab_size
        (torch.Size([2, 16]), 256)
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        data_dir: PathLike = "data",
        text: Optional[Union[PathLike, Sequence[PathLike]]] = None,
        seq_len: int = 256,
        batch_size: int = 8,
        num_workers: int = 0,
        tokenizer: Union[str, Tokenizer] = "byte",
        max_bytes: Optional[int] = None,
        val_fraction: float = 0.05,
        seed: int = 0,
        stride: Optional[int] = None,
        pin_memory: Optional[bool] = None,
        pack: bool = False,
    ) -> None:
        super().__init__()
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.data_dir = Path(data_dir)
        if text is not None and not isinstance(text, (str, os.PathLike)):
            text = [str(t) for t in text]  # also turns Hydra ListConfig into a plain list
        self.text = text
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.seed = seed
        self.stride = stride
        self.pin_memory = pin_memory
        self.pack = pack
        self.train_file: Optional[TokenFile] = None
        self.val_file: Optional[TokenFile] = None
        self.train_dataset: Optional[TokenWindowDataset] = None
        self.val_dataset: Optional[TokenWindowDataset] = None
        self._tokenizer_record: Optional[dict[str, Any]] = None

    def _doc_end(self, tokens: TokenFile) -> int:
        """The end-of-text id that ends every document of ``tokens`` (``pack=True``)."""
        eos = (tokens.tokenizer_record.get("special_ids") or {}).get("eos")
        if eos is None:
            raise ValueError(f"pack=True needs documents ended by an end-of-text id, but {str(tokens.path)!r} was "
                             f"tokenized by {tokens.tokenizer_record.get('name')!r}, which has none; use a tokenizer "
                             f"with one (a tiktoken name, a Hugging Face tokenizer directory) or pack=False")
        return int(eos)

    @property
    def train_path(self) -> Path:
        """``data_dir / "train.bin"``."""
        return self.data_dir / "train.bin"

    @property
    def val_path(self) -> Path:
        """``data_dir / "val.bin"``."""
        return self.data_dir / "val.bin"

    @property
    def tokenizer_name(self) -> str:
        """Name of the configured tokenizer (as recorded in the sidecars)."""
        return self._expected_tokenizer()["name"]

    def _expected_tokenizer(self) -> dict[str, Any]:
        """The configured tokenizer's record: by name for ``byte`` / tiktoken names (nothing loaded), the full
        :func:`~lightning_4d.data.tokenizer.tokenizer_record` for a tokenizer object or directory."""
        if isinstance(self.tokenizer, str) and not is_tokenizer_dir(self.tokenizer):
            return {"name": self.tokenizer}
        if self._tokenizer_record is None:
            self._tokenizer_record = tokenizer_record(get_tokenizer(self.tokenizer))
        return self._tokenizer_record

    @property
    def vocab_size(self) -> int:
        """Vocabulary size: from the token files after ``setup``, else from the tokenizer."""
        if self.train_file is not None:
            return self.train_file.vocab_size
        return get_tokenizer(self.tokenizer).vocab_size

    def _needs_prepare(self) -> bool:
        """Whether the token files in ``data_dir`` are missing or stale."""
        try:
            files = [TokenFile(self.train_path), TokenFile(self.val_path)]
        except (FileNotFoundError, ValueError):
            return True
        recorded = [f.meta.get("source") for f in files]
        if self.text is None and recorded[0] is not None and recorded[0].get("sources") is not None:
            return False  # prepared from user text elsewhere: use as is (setup checks the tokenizer)
        wanted = source_record(self.text, self.max_bytes, self.val_fraction)
        expected = self._expected_tokenizer()
        return any(r != wanted or tokenizer_difference(f.tokenizer_record, expected) is not None
                   for r, f in zip(recorded, files))

    @override
    def prepare_data(self) -> None:
        """Tokenize the corpus into ``data_dir`` unless up-to-date token files are there."""
        if self._needs_prepare():
            prepare(
                self.text,
                self.data_dir,
                tokenizer=self.tokenizer,
                val_fraction=self.val_fraction,
                max_bytes=self.max_bytes,
            )

    @override
    def setup(self, stage: str) -> None:
        """Open the token files (memory maps) and build the window datasets."""
        if self.train_file is not None:
            return
        train_file = TokenFile(self.train_path)
        val_file = TokenFile(self.val_path)
        expected = self._expected_tokenizer()
        for f in (train_file, val_file):
            f.check(tokenizer=expected if "vocab_size" in expected else expected["name"],
                    fix=f"re-run prepare with tokenizer={self.tokenizer!r}, or point data_dir elsewhere")
        val_file.check(vocab_size=train_file.vocab_size)
        doc_end = self._doc_end(train_file) if self.pack else None
        self.train_dataset = TokenWindowDataset(train_file, self.seq_len, self.stride, doc_end=doc_end)
        self.val_dataset = (TokenWindowDataset(val_file, self.seq_len, doc_end=doc_end)
                            if len(val_file) > self.seq_len else None)
        self.train_file, self.val_file = train_file, val_file

    def _require_setup(self) -> None:
        if self.train_dataset is None:
            raise RuntimeError(
                f"{type(self).__name__}: call prepare_data() and setup() before asking for data loaders"
            )

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded), ``drop_last=True`` batches of ``(inputs, targets)``."""
        self._require_setup()
        assert self.train_dataset is not None
        return _loader(self.train_dataset, self.batch_size, True, self.seed, self.num_workers,
                       _pin(self, self.pin_memory))

    @override
    def val_dataloader(self) -> DataLoader:
        """In-order, ``drop_last=True`` batches from the validation split."""
        self._require_setup()
        if self.val_dataset is None:
            assert self.val_file is not None
            raise ValueError(
                f"validation split {str(self.val_path)!r} has {len(self.val_file)} tokens, fewer than "
                f"seq_len + 1 = {self.seq_len + 1}; raise val_fraction or max_bytes, or lower seq_len"
            )
        return _loader(self.val_dataset, self.batch_size, False, self.seed, self.num_workers,
                       _pin(self, self.pin_memory))

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation split (there is no separate test split)."""
        return self.val_dataloader()


class SyntheticDataModule(L.LightningDataModule):
    """Synthetic ``(inputs, targets)`` batches for tests and benchmarks; no files, fully seeded.

    Args:
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        seq_len: tokens per sample.
        batch_size: samples per batch **per data-parallel rank**.
        num_train_samples: training set size.
        num_val_samples: validation set size.
        kind: ``"random"``, ``"increment"`` or ``"repeat"`` (see :class:`SyntheticTokenDataset`).
        period: motif length for ``"repeat"``.
        seed: seed of the data and of the training shuffle.
        num_workers: DataLoader worker processes.
        pin_memory: passed to the DataLoaders; ``None``: pinned when the Trainer trains on CUDA.

    Example:
        >>> dm = SyntheticDataModule(vocab_size=50, seq_len=4, batch_size=3)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.val_dataloader()))
        >>> x.shape, x.dtype
        (torch.Size([3, 4]), torch.int64)
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        batch_size: int = 8,
        num_train_samples: int = 256,
        num_val_samples: int = 32,
        kind: SyntheticKind = "random",
        period: int = 8,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: Optional[bool] = None,
    ) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.train_dataset = SyntheticTokenDataset(num_train_samples, seq_len, vocab_size, kind, period, seed, split=0)
        self.val_dataset = SyntheticTokenDataset(num_val_samples, seq_len, vocab_size, kind, period, seed, split=1)

    @override
    def setup(self, stage: str) -> None:
        """Nothing to do: the datasets are built in ``__init__`` and generate samples on demand."""

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded), ``drop_last=True`` training batches."""
        return _loader(self.train_dataset, self.batch_size, True, self.seed, self.num_workers,
                       _pin(self, self.pin_memory))

    @override
    def val_dataloader(self) -> DataLoader:
        """In-order, ``drop_last=True`` validation batches."""
        return _loader(self.val_dataset, self.batch_size, False, self.seed, self.num_workers,
                       _pin(self, self.pin_memory))

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation set."""
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader:
        """The validation set."""
        return self.val_dataloader()


class HFDataModule(L.LightningDataModule):
    """Batches from the files users have (JSONL, Parquet, Arrow, CSV, text), tokenized with a model's own
    Hugging Face tokenizer (offline): packed plain text, or chat / instruction conversations with the prompt
    tokens' targets set to ``ignore_index`` (the package's loss averages over the answer tokens only).

    ``prepare_data`` (Lightning runs it on one process per node; the other ranks wait) tokenizes once, in
    ``num_proc`` worker processes, into ``data_dir`` (:func:`~lightning_4d.data.prepared.prepare_dataset`);
    later runs find the files there and tokenize nothing. ``setup`` opens them memory-mapped and refuses files
    written by another tokenizer. Its result is :attr:`prepare_result` (``describe()`` gives the throughput).

    Args:
        files: data files or directories.
        data_dir: where the token files go.
        tokenizer: the model's tokenizer directory (usually the model directory).
        data_format: ``"text"`` (packed documents, EOS between them) or ``"chat"``.
        seq_len: tokens per sample.
        batch_size: samples per batch **per data-parallel rank**.
        val_files: a separate validation set (else ``val_fraction`` of the data).
        val_fraction: share of tokens (text) or conversations (chat) held out for validation.
        pack: exact packing. Chat: pack conversations into ``seq_len`` windows instead of one (padded) per
            sample; the samples are then ``(inputs, targets, position_ids)`` (see :class:`MaskedTokenDataset`).
            Text (always packed into windows): the samples carry ``position_ids`` restarting after each EOS, so
            attention stays within each document (``False``: ``(inputs, targets)`` windows whose attention
            crosses documents; see :class:`TokenWindowDataset`).
        mask_prompt: chat only: train on the answers only.
        num_proc: tokenization worker processes (``None``: by data size and CPU cores).
        num_workers: DataLoader worker processes.
        pin_memory: passed to the DataLoaders; ``None``: pinned when the Trainer trains on CUDA.
        seed: seed of the training shuffle and of the chat validation pick.
        ignore_index: target of prompt and padding tokens.
        **fields: ``text_field``, ``messages_field``, ``prompt_field``, ``response_field``, ``system_prompt``,
            ``text_sample_by`` (see :func:`~lightning_4d.data.prepared.prepare_dataset`).

    Example:
        >>> # not run: needs files (data files, a tokenizer)
        >>> dm = HFDataModule(["chat.jsonl"], "data/chat", "my-model", data_format="chat", seq_len=64)  # doctest: +SKIP
        >>> dm.prepare_data(); dm.setup("fit")  # doctest: +SKIP
        >>> x, y = next(iter(dm.train_dataloader()))  # doctest: +SKIP
        >>> bool((y == -100).any())  # prompt tokens are not targets  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        files: Union[PathLike, Sequence[PathLike]],
        data_dir: PathLike,
        tokenizer: Union[PathLike, Tokenizer],
        data_format: str = "text",
        seq_len: int = 256,
        batch_size: int = 8,
        val_files: Optional[Union[PathLike, Sequence[PathLike]]] = None,
        val_fraction: float = 0.05,
        pack: bool = False,
        mask_prompt: bool = True,
        num_proc: Optional[int] = None,
        num_workers: int = 0,
        seed: int = 0,
        ignore_index: int = -100,
        pin_memory: Optional[bool] = None,
        **fields: Optional[str],
    ) -> None:
        super().__init__()
        from lightning_4d.data.prepared import DATA_FORMATS

        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if data_format not in DATA_FORMATS:
            raise ValueError(f"data_format={data_format!r} is not one of {', '.join(map(repr, DATA_FORMATS))}")
        known = {"text_field", "messages_field", "prompt_field", "response_field", "system_prompt", "text_sample_by"}
        if set(fields) - known:
            raise TypeError(f"unknown arguments {sorted(set(fields) - known)}; known fields: {sorted(known)}")
        self.files = [str(f) for f in ([files] if isinstance(files, (str, os.PathLike)) else files)]
        self.val_files = None if val_files is None else [
            str(f) for f in ([val_files] if isinstance(val_files, (str, os.PathLike)) else val_files)]
        self.data_dir = Path(data_dir)
        self.tokenizer = tokenizer
        self.data_format = data_format
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_fraction, self.pack, self.mask_prompt = val_fraction, pack, mask_prompt
        self.num_proc, self.num_workers, self.seed, self.ignore_index = num_proc, num_workers, seed, ignore_index
        self.pin_memory = pin_memory
        self.fields = dict(fields)
        self.prepare_result: Optional[DatasetPrepareResult] = None
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None
        self._tok: Optional[Tokenizer] = None

    @property
    def tokenizer_object(self) -> Tokenizer:
        """The loaded tokenizer (:class:`~lightning_4d.data.tokenizer.HFTokenizer`)."""
        if self._tok is None:
            self._tok = get_tokenizer(self.tokenizer)
        return self._tok

    @property
    def vocab_size(self) -> int:
        """The tokenizer's number of ids (``len(tokenizer)``)."""
        return self.tokenizer_object.vocab_size

    @override
    def prepare_data(self) -> None:
        """Tokenize into ``data_dir`` unless files made from the same source are there (then nothing is read)."""
        from lightning.pytorch.utilities import rank_zero_info

        from lightning_4d.data.prepared import prepare_dataset

        self.prepare_result = prepare_dataset(
            self.files, self.data_dir, self.tokenizer_object, self.data_format, val_files=self.val_files,
            val_fraction=self.val_fraction, seed=self.seed, mask_prompt=self.mask_prompt, num_proc=self.num_proc,
            **self.fields)
        rank_zero_info(self.prepare_result.describe())

    @override
    def setup(self, stage: str) -> None:
        """Open the token files (memory maps), check their tokenizer, build the datasets."""
        if self.train_dataset is not None:
            return
        from lightning_4d.data.prepared import open_split

        expected = tokenizer_record(self.tokenizer_object)
        splits = []
        for split in ("train", "val"):
            tokens, mask, docs = open_split(self.data_dir, split)
            tokens.check(tokenizer=expected, fix=f"delete {str(self.data_dir)!r} or point data_dir elsewhere so "
                                                 f"the data is tokenized again with this tokenizer")
            fmt = tokens.meta.get("data_format")
            if fmt != self.data_format:
                raise ValueError(f"{str(tokens.path)!r} holds {fmt!r} data, not {self.data_format!r}; prepare it "
                                 f"again (prepare_data) or point data_dir elsewhere")
            if self.data_format == "chat":
                assert mask is not None and docs is not None
                splits.append(MaskedTokenDataset(tokens, mask, docs, self.seq_len, pack=self.pack,
                                                 pad_id=int(tokens.meta.get("pad_id", 0)),
                                                 ignore_index=self.ignore_index))
            else:
                doc_end = self.tokenizer_object.eot_id if self.pack else None
                splits.append(TokenWindowDataset(tokens, self.seq_len, doc_end=doc_end,
                                                 ignore_index=self.ignore_index))
        self.train_dataset, self.val_dataset = splits

    def _require_setup(self) -> None:
        if self.train_dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call prepare_data() and setup() before asking for data loaders")

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded), ``drop_last=True`` batches of ``(inputs, targets)``."""
        self._require_setup()
        assert self.train_dataset is not None
        return _loader(self.train_dataset, self.batch_size, True, self.seed, self.num_workers,
                       _pin(self, self.pin_memory))

    @override
    def val_dataloader(self) -> DataLoader:
        """In-order, ``drop_last=True`` batches of the validation split."""
        self._require_setup()
        assert self.val_dataset is not None
        return _loader(self.val_dataset, self.batch_size, False, self.seed, self.num_workers,
                       _pin(self, self.pin_memory))

    @override
    def test_dataloader(self) -> DataLoader:
        """The validation split."""
        return self.val_dataloader()
