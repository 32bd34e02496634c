"""The DataModule of the files users have, tokenized with the model's own Hugging Face tokenizer
(:class:`HFDataModule`).

Example:
    >>> HFDataModule.__name__
    'HFDataModule'
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import lightning as L
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_4d.data.tokenizer import Tokenizer, get_tokenizer, tokenizer_record
from lightning_4d.data.tokens import prepare

if TYPE_CHECKING:
    from lightning_4d.data.prepared import DatasetPrepareResult

from lightning_4d.data.datasets import MaskedTokenDataset, PathLike, TokenWindowDataset, _loader, _pin

__all__ = ["HFDataModule"]


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
        pin_memory: Optional[bool] = None,
        seed: int = 0,
        ignore_index: int = -100,
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
