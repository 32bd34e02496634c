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
from typing import Any, Optional, Union

import lightning as L
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_4d.data.tokenizer import (
    Tokenizer,
    get_tokenizer,
    is_tokenizer_dir,
    tokenizer_difference,
    tokenizer_record,
)
from lightning_4d.data.tokens import TokenFile, prepare, source_record

from lightning_4d.data.datasets import (
    MaskedTokenDataset, PathLike, SyntheticKind, SyntheticTokenDataset, TokenWindowDataset, _loader, _pin,
)
from lightning_4d.data.hf_datamodule import HFDataModule

__all__ = [
    "HFDataModule",
    "MaskedTokenDataset",
    "SyntheticDataModule",
    "SyntheticTokenDataset",
    "TextDataModule",
    "TokenWindowDataset",
]


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
