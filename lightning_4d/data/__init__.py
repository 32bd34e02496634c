"""Data for lightning_4d: tokenizers (byte, tiktoken, a model's own Hugging Face tokenizer offline),
memory-mapped token files, tokenization of JSONL / Parquet / Arrow / text files (packed text, chat with the
prompts masked) and DataModules.

Every DataModule here yields ``(inputs, targets)`` batches of token ids, the batch contract of
:class:`lightning_4d.FourDModule`; targets that are not trained on (prompts, padding) are ``-100``.

Example:
    >>> from lightning_4d.data import SyntheticDataModule
    >>> dm = SyntheticDataModule(vocab_size=64, seq_len=8, batch_size=2)
    >>> dm.setup("fit")
    >>> [t.shape for t in next(iter(dm.train_dataloader()))]
    [torch.Size([2, 8]), torch.Size([2, 8])]

Prepare token files from the command line (default corpus: the Python standard library)::

    python -m lightning_4d.data prepare --out data/stdlib --max-bytes 4000000
"""

from typing import TYPE_CHECKING

from lightning_4d.data.chat import ChatTemplateError, encode_chat, encode_chats, encode_texts, to_messages
from lightning_4d.data.prepared import DatasetPrepareResult, open_split, prepare_dataset
from lightning_4d.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    check_same_tokenizer,
    get_tokenizer,
    tokenizer_record,
)
from lightning_4d.data.tokens import (
    DEFAULT_MAX_BYTES,
    PrepareResult,
    TokenFile,
    TokenWriter,
    dtype_for_vocab,
    iter_texts,
    prepare,
    sidecar_path,
    stdlib_files,
    write_tokens,
)

if TYPE_CHECKING:
    from lightning_4d.data.datamodule import (
        HFDataModule,
        MaskedTokenDataset,
        SyntheticDataModule,
        SyntheticTokenDataset,
        TextDataModule,
        TokenWindowDataset,
    )

_LAZY = {"HFDataModule", "MaskedTokenDataset", "SyntheticDataModule", "SyntheticTokenDataset", "TextDataModule",
         "TokenWindowDataset"}


def __getattr__(name: str) -> type:
    # The DataModules import torch and Lightning; load them on first use so that the token-file
    # tools (and ``python -m lightning_4d.data``) start quickly.
    if name in _LAZY:
        from lightning_4d.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MAX_BYTES",
    "ByteTokenizer",
    "ChatTemplateError",
    "DatasetPrepareResult",
    "HFDataModule",
    "HFTokenizer",
    "MaskedTokenDataset",
    "PrepareResult",
    "SyntheticDataModule",
    "SyntheticTokenDataset",
    "TextDataModule",
    "TiktokenTokenizer",
    "TokenFile",
    "TokenWindowDataset",
    "TokenWriter",
    "Tokenizer",
    "check_same_tokenizer",
    "dtype_for_vocab",
    "encode_chat",
    "encode_chats",
    "encode_texts",
    "get_tokenizer",
    "iter_texts",
    "open_split",
    "prepare",
    "prepare_dataset",
    "sidecar_path",
    "stdlib_files",
    "to_messages",
    "tokenizer_record",
    "write_tokens",
]
