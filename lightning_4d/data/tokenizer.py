"""Tokenizers: a dependency-free byte tokenizer, an optional tiktoken-backed BPE one, and a model's own
Hugging Face tokenizer loaded offline from a local directory (:class:`HFTokenizer`).

Every tokenizer here has the same small surface (:class:`Tokenizer`): ``name``, ``vocab_size``,
``eot_id`` (end-of-text id or ``None``), ``encode(text) -> list[int]``,
``encode_array(text) -> np.ndarray`` and ``decode(ids) -> str``. :func:`tokenizer_record` describes one
(name, vocabulary size, special ids, a fingerprint of its vocabulary) for the sidecars of token files, and
:func:`check_same_tokenizer` refuses ids written by one tokenizer for a model that reads them with another.

Example:
    >>> tok = get_tokenizer("byte")
    >>> tok.vocab_size
    256
    >>> tok.decode(tok.encode("héllo"))
    'héllo'
    >>> tokenizer_record(tok)["vocab_size"]
    256
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "check_same_tokenizer",
    "get_tokenizer",
    "is_tokenizer_dir",
    "tokenizer_difference",
    "tokenizer_record",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Files of which at least one marks a directory holding a Hugging Face tokenizer (``save_pretrained``)."""

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


def _ids_to_list(ids: Iterable[int] | np.ndarray | torch.Tensor) -> list[int]:
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
        >>> # not run: needs files (a tokenizer directory or a tiktoken download)
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


def is_tokenizer_dir(path: Union[str, "os.PathLike[str]"]) -> bool:
    """Whether ``path`` is a directory holding a Hugging Face tokenizer (``tokenizer.json``,
    ``tokenizer_config.json``, ... as written by ``save_pretrained``).

    Example:
        >>> is_tokenizer_dir("byte")
        False
    """
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in TOKENIZER_FILES)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class HFTokenizer:
    """A model's own Hugging Face tokenizer, loaded with ``transformers.AutoTokenizer`` from local files only
    (nothing is downloaded; an offline cluster works).

    ``vocab_size`` is ``len(tokenizer)`` (added tokens included); ``eot_id`` the end-of-sequence id. ``encode``
    adds no special tokens (plain text to ids); :attr:`hf` is the ``transformers`` tokenizer itself (chat
    templates, ``add_special_tokens``, offsets).

    Args:
        path: a directory written by ``tokenizer.save_pretrained`` (usually the model directory).
        trust_remote_code: allow tokenizer code shipped in the directory.

    Raises:
        FileNotFoundError: ``path`` is not a directory or holds no tokenizer files.
        ImportError: ``transformers`` is not installed.

    Example:
        >>> # not run: needs files (a tokenizer directory or a tiktoken download)
        >>> tok = HFTokenizer("my-model")  # doctest: +SKIP
        >>> tok.decode(tok.encode("hello")), tok.eot_id  # doctest: +SKIP
        ('hello', 2)
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"], trust_remote_code: bool = False) -> None:
        p = Path(path)
        if not p.is_dir():
            raise FileNotFoundError(
                f"tokenizer directory {str(p)!r} does not exist: pass a local directory written by "
                "tokenizer.save_pretrained (usually the model directory), or 'byte'"
            )
        if not is_tokenizer_dir(p):
            raise FileNotFoundError(
                f"{str(p)!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): save the model's "
                "tokenizer there with tokenizer.save_pretrained(DIR)"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as err:  # pragma: no cover - transformers is a test dependency
            raise ImportError(
                f"tokenizer {str(p)!r} needs the optional package 'transformers' (pip install transformers)"
            ) from err
        self.path = p.absolute()
        self.name = f"hf:{self.path.name}"
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            str(self.path), local_files_only=True, trust_remote_code=trust_remote_code
        )
        self._vocab_sha: Optional[str] = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(tokenizer)``)."""
        return len(self.hf)

    @property
    def eot_id(self) -> int | None:
        """The end-of-sequence id (``eos_token_id``), or ``None``."""
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Encode ``text`` without special tokens."""
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_array(self, text: str) -> np.ndarray:
        """Encode ``text`` to a 1-D ``int64`` numpy array (no special tokens)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids back to text (special tokens kept)."""
        return self.hf.decode(_ids_to_list(ids))

    @property
    def vocab_sha256(self) -> str:
        """First 16 hex digits of the SHA-256 of the vocabulary (token → id, added tokens included): what the
        ids *mean*. Equal for the same tokenizer saved anywhere."""
        if self._vocab_sha is None:
            self._vocab_sha = _sha(json.dumps(sorted(self.hf.get_vocab().items()), ensure_ascii=False))
        return self._vocab_sha

    @property
    def processing_sha256(self) -> str:
        """SHA-256 (16 hex digits) of everything that turns text into ids: the backend's normaliser,
        pre-tokeniser, model, post-processor and added tokens, the chat template and the special tokens.
        Prepared data is re-tokenized when it changes."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        parts = {
            "backend": backend.to_str() if backend is not None else self.vocab_sha256,
            "chat_template": self.hf.chat_template if isinstance(self.hf.chat_template, str) else None,
            "special": {k: getattr(self.hf, k, None) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
        }
        return _sha(json.dumps(parts, sort_keys=True, default=str, ensure_ascii=False))

    def record(self) -> dict[str, Any]:
        """What token files record about this tokenizer (see :func:`tokenizer_record`)."""
        hf = self.hf
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "special_ids": {k: getattr(hf, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")},
            "vocab_sha256": self.vocab_sha256,
        }

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def tokenizer_record(tok: Union[str, Tokenizer]) -> dict[str, Any]:
    """Name, vocabulary size, special ids and (for Hugging Face tokenizers) a vocabulary fingerprint: what a
    token file records about the tokenizer that wrote it, and what :func:`check_same_tokenizer` compares.

    Example:
        >>> tokenizer_record("byte")
        {'name': 'byte', 'vocab_size': 256, 'special_ids': {'eos': None}}
    """
    tok = get_tokenizer(tok)
    record = getattr(tok, "record", None)
    if callable(record):
        return dict(record())
    return {"name": tok.name, "vocab_size": int(tok.vocab_size), "special_ids": {"eos": tok.eot_id}}


def _describe(record: Mapping[str, Any]) -> str:
    ids = ", ".join(f"{k} {v}" for k, v in sorted((record.get("special_ids") or {}).items()) if v is not None)
    sha = f", vocabulary {record['vocab_sha256']}" if record.get("vocab_sha256") else ""
    return f"{record.get('name')!r} ({record.get('vocab_size')} ids{', ' + ids if ids else ''}{sha})"


def tokenizer_difference(recorded: Mapping[str, Any], expected: Mapping[str, Any]) -> Optional[str]:
    """Why two tokenizer records (:func:`tokenizer_record`) describe different tokenizers, or ``None``.

    Two Hugging Face tokenizers are the same when their vocabularies are (wherever they are saved); others
    by name. The vocabulary size and every special id both records name must also agree.

    Example:
        >>> tokenizer_difference(tokenizer_record("byte"), tokenizer_record("byte")) is None
        True
        >>> tokenizer_difference({"name": "byte", "vocab_size": 256}, {"name": "gpt2", "vocab_size": 50257})
        'the tokenizers differ'
    """
    a, b = recorded.get("vocab_sha256"), expected.get("vocab_sha256")
    if a and b:
        if a != b:
            return "their vocabularies differ"
    elif recorded.get("name") != expected.get("name"):
        return "the tokenizers differ"
    if recorded.get("vocab_size") is not None and expected.get("vocab_size") is not None \
            and int(recorded["vocab_size"]) != int(expected["vocab_size"]):
        return "their vocabulary sizes differ"
    ra, rb = recorded.get("special_ids") or {}, expected.get("special_ids") or {}
    for key in sorted(set(ra) & set(rb)):
        if ra[key] != rb[key]:
            return f"their {key} ids differ"
    return None


def check_same_tokenizer(recorded: Mapping[str, Any], expected: Mapping[str, Any], what: str, fix: str) -> None:
    """Raise :class:`ValueError` when ``what`` (e.g. a token file) was written by another tokenizer than the one
    expected (the model's): its ids would mean other tokens.

    Example:
        >>> check_same_tokenizer(tokenizer_record("byte"), tokenizer_record("byte"), "x.bin", "re-run prepare")
        >>> check_same_tokenizer({"name": "gpt2", "vocab_size": 50257}, tokenizer_record("byte"), "x.bin", "fix it")
        Traceback (most recent call last):
        ...
        ValueError: x.bin was tokenized by 'gpt2' (50257 ids) but the expected tokenizer is 'byte' (256 ids): ...
    """
    reason = tokenizer_difference(recorded, expected)
    if reason is not None:
        raise ValueError(
            f"{what} was tokenized by {_describe(recorded)} but the expected tokenizer is {_describe(expected)}: "
            f"{reason}, so its ids would mean other tokens. {fix}"
        )


def get_tokenizer(name: Union[str, "os.PathLike[str]", Tokenizer] = "byte") -> Tokenizer:
    """Return a tokenizer: ``"byte"``, a local directory holding a Hugging Face tokenizer (the model's own,
    loaded offline: :class:`HFTokenizer`), or a tiktoken encoding such as ``"gpt2"``.

    A tokenizer object is returned unchanged. tiktoken names need ``tiktoken`` (without it an
    :class:`ImportError` says so), directories need ``transformers``.

    Example:
        >>> get_tokenizer("byte").vocab_size
        256
        >>> # not run: needs files (a tokenizer directory or a tiktoken download)
        >>> get_tokenizer("my-model-dir").name  # doctest: +SKIP
        'hf:my-model-dir'
        >>> get_tokenizer("gpt2").vocab_size  # doctest: +SKIP
        50257
    """
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str):
        if isinstance(name, Tokenizer):
            return name
        raise TypeError(f"expected a tokenizer name or tokenizer object, got {type(name).__name__}")
    if name == "byte":
        return ByteTokenizer()
    if is_tokenizer_dir(name):
        return HFTokenizer(name)
    if os.sep in name or Path(name).exists():
        raise FileNotFoundError(
            f"tokenizer {name!r} is a path but not a directory holding a Hugging Face tokenizer "
            f"({', '.join(TOKENIZER_FILES[:2])}, ...): pass the model directory written by save_pretrained"
        )
    return TiktokenTokenizer(name)
