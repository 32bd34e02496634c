"""The ``data`` group's schemas: token files (:class:`TextDataConfig`), synthetic batches
(:class:`SyntheticDataConfig`) and your own files with the model's tokenizer (:class:`HFDataConfig`).

Example:
    >>> SyntheticDataConfig().kind
    'repeat'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

from lightning_4d.recipes.errors import RecipeConfigError, _non_negative, _one_of, _positive

__all__ = ["DataConfig", "HFDataConfig", "SyntheticDataConfig", "TextDataConfig"]


@dataclass
class TextDataConfig:
    """:class:`~lightning_4d.data.TextDataModule`: token files in ``data_dir``, prepared from
    ``text`` (files or directories; ``null``: the Python standard library's sources) on first use.
    ``prepare: false`` requires existing files (a directory made by ``python -m lightning_4d.data
    prepare``). A relative ``data_dir`` is relative to the directory the command was started in.
    ``batch_size`` is per data-parallel rank. ``pack: true``: exact packing, ``position_ids`` restarting after each
    file's end-of-text id (a tokenizer with one: tiktoken, Hugging Face), so attention stays within a file.

    Example:
        >>> TextDataConfig(seq_len=64).tokenizer
        'byte'
    """

    name: str = "text"
    data_dir: str = "data/stdlib"
    text: Optional[List[str]] = None
    prepare: bool = True
    tokenizer: str = "byte"
    max_bytes: Optional[int] = None
    val_fraction: float = 0.05
    seq_len: int = 128
    batch_size: int = 8
    stride: Optional[int] = None
    num_workers: int = 0
    pin_memory: Optional[bool] = None  # None: pinned when training on CUDA
    seed: int = 0
    pack: bool = False

    def __post_init__(self) -> None:
        _positive("data.seq_len", self.seq_len)
        _positive("data.batch_size", self.batch_size)
        _positive("data.max_bytes", self.max_bytes, allow_none=True)
        _positive("data.stride", self.stride, allow_none=True)
        _non_negative("data.num_workers", self.num_workers)
        if not 0.0 < self.val_fraction < 1.0:
            raise RecipeConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 1).")
        if self.text is not None and not self.prepare:
            raise RecipeConfigError("data.text is given but data.prepare=false: set data.prepare=true or drop text.")


@dataclass
class SyntheticDataConfig:
    """:class:`~lightning_4d.data.SyntheticDataModule`: seeded synthetic tokens, no files.

    Example:
        >>> SyntheticDataConfig().kind
        'repeat'
    """

    name: str = "synthetic"
    vocab_size: int = 256
    seq_len: int = 128
    batch_size: int = 8
    num_train_samples: int = 4096
    num_val_samples: int = 64
    kind: str = "repeat"
    period: int = 8
    seed: int = 0
    num_workers: int = 0
    pin_memory: Optional[bool] = None  # None: pinned when training on CUDA

    def __post_init__(self) -> None:
        for key in ("vocab_size", "seq_len", "batch_size", "num_train_samples", "num_val_samples", "period"):
            _positive(f"data.{key}", getattr(self, key))
        _one_of("data.kind", self.kind, ("random", "increment", "repeat"))
        _non_negative("data.num_workers", self.num_workers)


@dataclass
class HFDataConfig:
    """:class:`~lightning_4d.data.HFDataModule`: the files users have (``files``: JSONL / JSON, Parquet, Arrow,
    CSV, text, or directories of them; read with the ``datasets`` library, nothing downloaded) tokenized with the
    model's own Hugging Face tokenizer (``tokenizer``: a local directory, or ``auto``: ``model.path``) once, in
    ``num_proc`` worker processes (``null``: by size and CPU cores), into ``data_dir``; later runs reuse the files.

    ``format``: ``text`` (each document + EOS, packed into ``seq_len`` windows; with ``pack`` exactly:
    ``position_ids`` restart after each EOS; the text in ``text_field``; text files give a row per
    ``text_sample_by``: ``document``, ``paragraph`` or ``line``) or ``chat`` (``messages_field``
    conversations, or ``prompt_field`` / ``response_field`` instruction rows, through the tokenizer's chat
    template; with ``mask_prompt`` only the answers are targets; one conversation per sample, padded, or packed
    with ``pack``, exactly: ``position_ids`` keep attention within each conversation; ``system_prompt`` added
    where a conversation has none). Validation: ``val_files``, else a
    ``val_fraction`` of the tokens (text) or of the conversations (chat, picked with ``seed``). ``batch_size`` is
    per data-parallel rank.

    Example:
        >>> HFDataConfig(files=["chat.jsonl"], format="chat").tokenizer
        'auto'
        >>> HFDataConfig(files=["a.jsonl"], format="html")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.errors.RecipeConfigError: data.format='html' is not one of 'text', 'chat'.
    """

    name: str = "hf_text"
    format: str = "text"
    files: Optional[List[str]] = None
    val_files: Optional[List[str]] = None
    tokenizer: str = "auto"
    data_dir: str = "data/hf_text"
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.05
    pack: bool = False
    mask_prompt: bool = True
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_prompt: Optional[str] = None
    text_sample_by: str = "document"
    num_proc: Optional[int] = None
    num_workers: int = 0
    pin_memory: Optional[bool] = None  # None: pinned when training on CUDA
    seed: int = 0

    def __post_init__(self) -> None:
        _one_of("data.format", self.format, ("text", "chat"))
        if not self.files:
            raise RecipeConfigError(f"data={self.name} needs data.files: local data files or directories, e.g. "
                                    f"'data.files=[my_data.jsonl]'.")
        _positive("data.seq_len", self.seq_len)
        _positive("data.batch_size", self.batch_size)
        _positive("data.num_proc", self.num_proc, allow_none=True)
        _non_negative("data.num_workers", self.num_workers)
        _one_of("data.text_sample_by", self.text_sample_by, ("document", "paragraph", "line"))
        if not self.val_files and not 0.0 < self.val_fraction < 1.0:
            raise RecipeConfigError(
                f"data.val_fraction={self.val_fraction} must be in (0, 1) (or give data.val_files).")


DataConfig = Union[TextDataConfig, SyntheticDataConfig, HFDataConfig]
