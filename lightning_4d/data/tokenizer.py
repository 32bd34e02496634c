"""Tokenizers: a dependency-free byte tokenizer and an optional tiktoken-backed BPE one.

Every tokenizer here has the same small surface (:class:`Tokenizer`): ``name``, ``vocab_size``,
``eot_id`` (end-of-text id or ``None``), ``encode(text) -> list[int]``,
``encode_array(text) -> np.ndarray`` and ``decode(ids) -> str``.

Example:
    >>> tok = get_tokenizer("byte")
    >>> tok.vocab_size
    256
    >>> tok.decode(tok.encode("héllo"))
    'héllo'
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np

__all__ = ["ByteTokenizer", "TiktokenTokenizer", "Tokenizer", "get_tokenizer"]

EOT = "<|endoftext|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    Example:
        >>> isinstance(ByteTokenizer(), Tokenizer)
        True
    """

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eot_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _ids_to_list(ids: Iterable[int] | np.ndarray | Any) -> list[int]:
    if hasattr(ids, "tolist"):  # numpy arrays and torch tensors
        ids = ids.tolist()
    return [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, then optional special tokens.

    Args:
        special_tokens: extra token strings that get ids ``256, 257, ...`` in order. They are
            only recognised inside text when ``encode(..., allow_special=True)``.

    Example:
        >>> tok = ByteTokenizer(special_tokens=["<|endoftext|>"])
        >>> tok.vocab_size, tok.eot_id
        (257, 256)
        >>> tok.encode("hi<|endoftext|>", allow_special=True)
        [104, 105, 256]
        >>> tok.decode([104, 105, 256])
        'hi<|endoftext|>'
    """

    name = "byte"

    def __init__(self, special_tokens: Sequence[str] = ()) -> None:
        if len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"duplicate special tokens: {list(special_tokens)}")
        if any(not s for s in special_tokens):
            raise ValueError("special tokens must be non-empty strings")
        self.special_tokens: dict[str, int] = {s: 256 + i for i, s in enumerate(special_tokens)}
        self._id_to_special = {i: s for s, i in self.special_tokens.items()}
        self._special_re = (
            re.compile("(" + "|".join(re.escape(s) for s in sorted(special_tokens, key=len, reverse=True)) + ")")
            if special_tokens
            else None
        )

    @property
    def vocab_size(self) -> int:
        """256 byte values plus the number of special tokens."""
        return 256 + len(self.special_tokens)

    @property
    def eot_id(self) -> int | None:
        """Id of ``<|endoftext|>`` if it is one of the special tokens, else ``None``."""
        return self.special_tokens.get(EOT)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Encode ``text`` to a list of token ids.

        Example:
            >>> ByteTokenizer().encode("A€")
            [65, 226, 130, 172]
        """
        return self.encode_array(text, allow_special=allow_special).tolist()

    def encode_array(self, text: str, allow_special: bool = False) -> np.ndarray:
        """Encode ``text`` to a 1-D ``int64`` numpy array (fast path for large corpora).

        Example:
            >>> ByteTokenizer().encode_array("ab")
            array([97, 98])
        """
        if not allow_special or self._special_re is None:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        parts: list[np.ndarray] = []
        for piece in self._special_re.split(text):
            if not piece:
                continue
            if piece in self.special_tokens:
                parts.append(np.array([self.special_tokens[piece]], dtype=np.int64))
            else:
                parts.append(np.frombuffer(piece.encode("utf-8"), dtype=np.uint8).astype(np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids back to text; invalid UTF-8 sequences become U+FFFD.

        Example:
            >>> ByteTokenizer().decode([104, 105])
            'hi'
        """
        out: list[str] = []
        buf = bytearray()
        for i in _ids_to_list(ids):
            if 0 <= i < 256:
                buf.append(i)
            elif i in self._id_to_special:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append(self._id_to_special[i])
            else:
                raise ValueError(f"token id {i} is outside the vocabulary of size {self.vocab_size}")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return f"ByteTokenizer(special_tokens={list(self.special_tokens)})"


class TiktokenTokenizer:
    """BPE tokenizer backed by the optional ``tiktoken`` package (e.g. ``"gpt2"``).

    Note that ``tiktoken`` fetches its BPE ranks on first use of an encoding and caches them;
    on a machine without network access the cache must already hold them.

    Args:
        name: a tiktoken encoding name (``gpt2``, ``cl100k_base``, ...) or model name.

    Example:
        >>> tok = TiktokenTokenizer("gpt2")  # doctest: +SKIP
        >>> tok.vocab_size, tok.eot_id  # doctest: +SKIP
        (50257, 50256)
    """

    def __init__(self, name: str) -> None:
        try:
            import tiktoken
        except ImportError as err:
            raise ImportError(
                f"tokenizer {name!r} needs the optional package 'tiktoken' (pip install tiktoken); "
                "use tokenizer='byte' for the dependency-free byte tokenizer"
            ) from err
        try:
            enc = tiktoken.get_encoding(name)
        except (ValueError, KeyError):
            try:
                enc = tiktoken.encoding_for_model(name)
            except KeyError as err:
                raise ValueError(
                    f"unknown tokenizer {name!r}: not 'byte' and not a tiktoken encoding or model name"
                ) from err
        self.name = name
        self._enc = enc

    @property
    def vocab_size(self) -> int:
        """Number of token ids (``n_vocab`` of the encoding)."""
        return int(self._enc.n_vocab)

    @property
    def eot_id(self) -> int | None:
        """The encoding's end-of-text id."""
        return getattr(self._enc, "eot_token", None)

    def encode(self, text: str) -> list[int]:
        """Encode ``text``; special-token strings in the text are treated as ordinary text."""
        return list(self._enc.encode_ordinary(text))

    def encode_array(self, text: str) -> np.ndarray:
        """Encode ``text`` to a 1-D ``int64`` numpy array."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids back to text."""
        return self._enc.decode(_ids_to_list(ids))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.name!r})"


def get_tokenizer(name: Union[str, Tokenizer] = "byte") -> Tokenizer:
    """Return a tokenizer by name: ``"byte"`` or a tiktoken encoding such as ``"gpt2"``.

    A tokenizer object is returned unchanged. Names other than ``"byte"`` need ``tiktoken``;
    without it an :class:`ImportError` says so.

    Example:
        >>> get_tokenizer("byte").vocab_size
        256
        >>> get_tokenizer("gpt2").vocab_size  # doctest: +SKIP
        50257
    """
    if not isinstance(name, str):
        if isinstance(name, Tokenizer):
            return name
        raise TypeError(f"expected a tokenizer name or tokenizer object, got {type(name).__name__}")
    if name == "byte":
        return ByteTokenizer()
    return TiktokenTokenizer(name)
