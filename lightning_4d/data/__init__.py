"""Data for lightning_4d: tokenizers, memory-mapped token files and DataModules.

Every DataModule here yields ``(inputs, targets)`` batches of token ids, the batch contract of
:class:`lightning_4d.FourDModule`.

Example:
    >>> from lightning_4d.data import SyntheticDataModule
    >>> dm = SyntheticDataModule(vocab_size=64, seq_len=8, batch_size=2)
    >>> dm.setup("fit")
    >>> [t.shape for t in next(iter(dm.train_dataloader()))]
    [torch.Size([2, 8]), torch.Size([2, 8])]

Prepare token files from the command line (default corpus: the Python standard library)::

    python -m lightning_4d.data prepare --out data/stdlib --max-bytes 4000000
"""

from typing import TYPE_CHECKING, Any

from lightning_4d.data.tokenizer import ByteTokenizer, TiktokenTokenizer, Tokenizer, get_tokenizer
from lightning_4d.data.tokens import (
    DEFAULT_MAX_BYTES,
    PrepareResult,
    TokenFile,
    dtype_for_vocab,
    iter_texts,
    prepare,
    sidecar_path,
    stdlib_files,
    write_tokens,
)

if TYPE_CHECKING:
    from lightning_4d.data.datamodule import (
        SyntheticDataModule,
        SyntheticTokenDataset,
        TextDataModule,
        TokenWindowDataset,
    )

_LAZY = {"SyntheticDataModule", "SyntheticTokenDataset", "TextDataModule", "TokenWindowDataset"}


def __getattr__(name: str) -> Any:
    # The DataModules import torch and Lightning; load them on first use so that the token-file
    # tools (and ``python -m lightning_4d.data``) start quickly.
    if name in _LAZY:
        from lightning_4d.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MAX_BYTES",
    "ByteTokenizer",
    "PrepareResult",
    "SyntheticDataModule",
    "SyntheticTokenDataset",
    "TextDataModule",
    "TiktokenTokenizer",
    "TokenFile",
    "TokenWindowDataset",
    "Tokenizer",
    "dtype_for_vocab",
    "get_tokenizer",
    "iter_texts",
    "prepare",
    "sidecar_path",
    "stdlib_files",
    "write_tokens",
]
