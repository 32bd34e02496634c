"""Memory-mapped token files (nanoGPT style) and corpus preparation.

A token file is a flat binary ``<name>.bin`` of ``uint16`` token ids (``uint32`` when the
vocabulary has more than 65536 entries) plus a JSON sidecar ``<name>.bin.json``::

    {"format": "lightning_4d.tokens", "version": 1, "dtype": "uint16",
     "vocab_size": 256, "num_tokens": 123456, "tokenizer": "byte", ...}

Both files are written to a temporary name and renamed into place (sidecar last), so a reader
never sees a half-written file and concurrent writers of the same content do not corrupt it.

:func:`prepare` turns text files or directories into ``train.bin`` / ``val.bin``. Without text
it uses a corpus present on every machine: the ``.py`` sources of Python's standard library.

Example:
    >>> import tempfile, os
    >>> tmp = tempfile.TemporaryDirectory()
    >>> tf = write_tokens(os.path.join(tmp.name, "x.bin"), [1, 2, 3], vocab_size=256, tokenizer="byte")
    >>> len(tf), tf.dtype, tf[1:3].tolist()
    (3, dtype('uint16'), [2, 3])
    >>> tmp.cleanup()
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Optional, Union

import numpy as np

from lightning_4d.data.tokenizer import Tokenizer, check_same_tokenizer, get_tokenizer, tokenizer_record

if TYPE_CHECKING:
    from numpy.typing import ArrayLike, DTypeLike

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PrepareResult",
    "TokenFile",
    "TokenWriter",
    "dtype_for_vocab",
    "iter_texts",
    "prepare",
    "sidecar_path",
    "source_record",
    "stdlib_files",
    "write_tokens",
]

PathLike = Union[str, "os.PathLike[str]"]

FORMAT = "lightning_4d.tokens"
VERSION = 1
DEFAULT_MAX_BYTES = 4_000_000
"""Byte cap for the default standard-library corpus."""
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
"""File suffixes taken from a directory given to :func:`prepare`."""
_ALLOWED_DTYPES = ("uint16", "uint32")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds ids ``0 .. vocab_size-1`` (``uint16`` or ``uint32``).

    Example:
        >>> dtype_for_vocab(50257), dtype_for_vocab(100277)
        (dtype('uint16'), dtype('uint32'))
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def sidecar_path(path: PathLike) -> Path:
    """Path of the JSON sidecar of a token file: ``<path>.json``.

    Example:
        >>> sidecar_path("data/train.bin").name
        'train.bin.json'
    """
    p = Path(path)
    return p.with_name(p.name + ".json")


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _atomic_write_bytes(path: Path, data: Union[bytes, memoryview]) -> None:
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _tokenizer_meta(tokenizer: Union[str, Tokenizer], vocab_size: int) -> tuple[str, dict[str, Any]]:
    """The sidecar's ``tokenizer`` name and ``tokenizer_info`` record (a name is not instantiated)."""
    if isinstance(tokenizer, str):
        return tokenizer, {"name": tokenizer, "vocab_size": int(vocab_size)}
    record = tokenizer_record(tokenizer)
    return tokenizer.name, record


class TokenWriter:
    """Stream token ids into a token file: chunks go to a temporary file, which :meth:`close` renames into
    place, then writes the sidecar (last), so readers never see a partial file. As a context manager it
    closes on success and removes the temporary file on an exception.

    Args:
        path: the ``.bin`` file to write (parent directories are created).
        vocab_size: vocabulary size; selects ``uint16`` or ``uint32``; every id must be below it.
        tokenizer: tokenizer name, or the tokenizer object (its :func:`tokenizer_record` is stored).
        extra: more JSON-serialisable metadata stored in the sidecar.

    Example:
        >>> import tempfile, os
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with TokenWriter(os.path.join(tmp.name, "s.bin"), vocab_size=256) as w:
        ...     w.write([1, 2]); w.write(np.array([3]))
        >>> w.result.tokens.tolist(), w.result.tokenizer_record
        ([1, 2, 3], {'name': 'byte', 'vocab_size': 256})
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        path: PathLike,
        vocab_size: int,
        tokenizer: Union[str, Tokenizer] = "byte",
        extra: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.path = Path(path)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        name, record = _tokenizer_meta(tokenizer, self.vocab_size)
        self.meta: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "num_tokens": 0,
            "tokenizer": name,
            "tokenizer_info": record,
        }
        if extra:
            clash = set(extra) & set(self.meta)
            if clash:
                raise ValueError(f"extra metadata may not override {sorted(clash)}")
            self.meta.update(extra)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = _tmp_name(self.path)
        self._fh: BinaryIO = open(self._tmp, "wb")
        self.num_tokens = 0
        self.result: Optional[TokenFile] = None

    def write(self, tokens: ArrayLike) -> None:
        """Append a 1-D array-like of ids in ``[0, vocab_size)``."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if not arr.size:
            return
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got min {lo} and max {hi}")
        self._fh.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self.num_tokens += int(arr.size)

    def close(self) -> "TokenFile":
        """Flush, rename into place, write the sidecar; return the opened :class:`TokenFile`."""
        if self.result is not None:
            return self.result
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self._tmp, self.path)
        self.meta["num_tokens"] = self.num_tokens
        _atomic_write_bytes(sidecar_path(self.path), (json.dumps(self.meta, indent=2, sort_keys=True) + "\n").encode())
        self.result = TokenFile(self.path)
        return self.result

    def abort(self) -> None:
        """Drop what was written (the previous file at ``path``, if any, is left as it was)."""
        if not self._fh.closed:
            self._fh.close()
        if self._tmp.exists():
            self._tmp.unlink()

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_tokens(
    path: PathLike,
    tokens: ArrayLike,
    vocab_size: int,
    tokenizer: Union[str, Tokenizer] = "byte",
    extra: Optional[Mapping[str, Any]] = None,
) -> "TokenFile":
    """Write a 1-D sequence of token ids to ``path`` plus its sidecar; return the opened file.

    Args:
        path: the ``.bin`` file to write (parent directories are created).
        tokens: 1-D array-like of non-negative ids smaller than ``vocab_size``.
        vocab_size: vocabulary size; selects ``uint16`` or ``uint32``.
        tokenizer: tokenizer name, or the tokenizer object (its :func:`tokenizer_record`, with special ids
            and vocabulary fingerprint, is stored as ``tokenizer_info``).
        extra: more JSON-serialisable metadata stored in the sidecar (e.g. the corpus source).

    Example:
        >>> import tempfile, os
        >>> tmp = tempfile.TemporaryDirectory()
        >>> p = os.path.join(tmp.name, "big.bin")
        >>> write_tokens(p, [0, 70000], vocab_size=100277, tokenizer="cl100k_base").dtype
        dtype('uint32')
        >>> tmp.cleanup()
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    with TokenWriter(path, vocab_size, tokenizer, extra) as writer:
        writer.write(arr)
    assert writer.result is not None
    return writer.result


class TokenFile:
    """A read-only, memory-mapped token file written by :func:`write_tokens`.

    Indexing and slicing return numpy data straight from the memory map; nothing is loaded
    up front. The object pickles cheaply (the map is reopened lazily), so it can go to
    DataLoader worker processes.

    Args:
        path: the ``.bin`` file; its sidecar ``<path>.json`` must exist next to it.

    Raises:
        FileNotFoundError: the ``.bin`` or its sidecar is missing.
        ValueError: the sidecar is malformed or disagrees with the file size.

    Example:
        >>> import tempfile, os
        >>> tmp = tempfile.TemporaryDirectory()
        >>> p = os.path.join(tmp.name, "t.bin")
        >>> _ = write_tokens(p, [5, 6, 7, 8], vocab_size=256)
        >>> tf = TokenFile(p)
        >>> tf.num_tokens, tf.vocab_size, tf.tokenizer, tf[-2:].tolist()
        (4, 256, 'byte', [7, 8])
        >>> tmp.cleanup()
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        side = sidecar_path(self.path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"token file {str(self.path)!r} not found; create it with "
                "`python -m lightning_4d.data prepare --out DIR` or lightning_4d.data.prepare()"
            )
        if not side.is_file():
            raise FileNotFoundError(f"sidecar {str(side)!r} of token file {str(self.path)!r} not found")
        try:
            meta = json.loads(side.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"sidecar {str(side)!r} is not valid JSON: {err}") from err
        missing = [k for k in ("dtype", "vocab_size", "num_tokens", "tokenizer") if k not in meta]
        if missing:
            raise ValueError(f"sidecar {str(side)!r} lacks keys {missing}")
        if meta["dtype"] not in _ALLOWED_DTYPES:
            raise ValueError(f"sidecar {str(side)!r}: dtype {meta['dtype']!r} is not one of {_ALLOWED_DTYPES}")
        self.meta: dict[str, Any] = meta
        self.dtype = np.dtype(meta["dtype"])
        self.vocab_size = int(meta["vocab_size"])
        self.num_tokens = int(meta["num_tokens"])
        self.tokenizer: str = str(meta["tokenizer"])
        if self.dtype.itemsize < dtype_for_vocab(self.vocab_size).itemsize:
            raise ValueError(
                f"sidecar {str(side)!r}: dtype {self.dtype.name} cannot hold vocab_size {self.vocab_size}"
            )
        size = self.path.stat().st_size
        if size != self.num_tokens * self.dtype.itemsize:
            raise ValueError(
                f"sidecar mismatch for {str(self.path)!r}: sidecar says {self.num_tokens} {self.dtype.name} tokens "
                f"({self.num_tokens * self.dtype.itemsize} bytes) but the file has {size} bytes"
            )
        self._data: Optional[np.ndarray] = None

    @property
    def tokens(self) -> np.ndarray:
        """The whole file as a read-only 1-D array (a ``np.memmap``; empty files give an empty array)."""
        if self._data is None:
            if self.num_tokens == 0:
                self._data = np.zeros(0, dtype=self.dtype)
            else:
                self._data = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._data

    @property
    def tokenizer_record(self) -> dict[str, Any]:
        """What the sidecar records about the tokenizer that wrote the file: name, vocabulary size and, for
        files written by this version, special ids and a vocabulary fingerprint (see
        :func:`~lightning_4d.data.tokenizer.tokenizer_record`)."""
        info = self.meta.get("tokenizer_info")
        if isinstance(info, dict):
            return dict(info)
        return {"name": self.tokenizer, "vocab_size": self.vocab_size}

    def check(self, vocab_size: Optional[int] = None, tokenizer: Optional[Union[str, Mapping[str, Any]]] = None,
              fix: str = "re-run prepare with the same tokenizer") -> None:
        """Raise :class:`ValueError` if the sidecar disagrees with the expected vocab size or tokenizer
        (a name, or a :func:`~lightning_4d.data.tokenizer.tokenizer_record` compared by vocabulary and special
        ids, wherever the tokenizer is saved).

        Example:
            >>> import tempfile, os
            >>> tmp = tempfile.TemporaryDirectory()
            >>> tf = write_tokens(os.path.join(tmp.name, "t.bin"), [1], vocab_size=256)
            >>> tf.check(vocab_size=256, tokenizer="byte")
            >>> tmp.cleanup()
        """
        if isinstance(tokenizer, Mapping):
            check_same_tokenizer(self.tokenizer_record, tokenizer, f"token file {str(self.path)!r}", fix)
        elif tokenizer is not None and tokenizer != self.tokenizer:
            raise ValueError(
                f"sidecar mismatch for {str(self.path)!r}: written with tokenizer {self.tokenizer!r}, "
                f"expected {tokenizer!r}; {fix}"
            )
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(
                f"sidecar mismatch for {str(self.path)!r}: vocab_size {self.vocab_size}, expected {vocab_size}"
            )

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, idx: Any) -> Any:
        return self.tokens[idx]

    def __array__(self, dtype: Optional[DTypeLike] = None, copy: Optional[bool] = None) -> np.ndarray:
        arr = np.asarray(self.tokens)
        return arr if dtype is None else arr.astype(dtype)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_data"] = None  # reopen the map in the receiving process instead of copying data
        return state

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.path)!r}, num_tokens={self.num_tokens}, dtype={self.dtype.name}, "
            f"vocab_size={self.vocab_size}, tokenizer={self.tokenizer!r})"
        )


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path (third-party packages excluded).

    Example:
        >>> files = stdlib_files()
        >>> all(f.suffix == ".py" for f in files) and len(files) > 100
        True
    """
    return list(_stdlib_files(sysconfig.get_paths()["stdlib"]))


@functools.lru_cache(maxsize=4)
def _stdlib_files(stdlib: str) -> tuple[Path, ...]:
    root = Path(stdlib)
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {str(root)!r} not found")
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if p.is_file() and not skip.intersection(p.relative_to(root).parts)]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def _expand(sources: Sequence[PathLike], suffixes: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(
                (f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes),
                key=lambda f: f.relative_to(p).as_posix(),
            )
            if not found:
                raise ValueError(f"directory {str(p)!r} contains no text files with suffixes {list(suffixes)}")
            files.extend(found)
        else:
            raise FileNotFoundError(f"text source {str(p)!r} does not exist")
    return files


def iter_texts(
    sources: Optional[Sequence[PathLike]] = None,
    max_bytes: Optional[int] = None,
    suffixes: Sequence[str] = TEXT_SUFFIXES,
) -> Iterator[tuple[Path, str]]:
    """Yield ``(path, text)`` for each document, in a deterministic order, up to ``max_bytes``.

    Args:
        sources: files and/or directories (directories are searched recursively for
            ``suffixes``); ``None`` means the standard library's ``.py`` files.
        max_bytes: stop after this many bytes of raw text; the last file is cut to fit.
        suffixes: file suffixes taken from directories.

    Example:
        >>> docs = list(iter_texts(max_bytes=1000))
        >>> sum(len(t.encode()) for _, t in docs) <= 1000
        True
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    files = stdlib_files() if sources is None else _expand(sources, suffixes)
    budget = max_bytes
    for f in files:
        raw = f.read_bytes()
        if budget is not None:
            if budget <= 0:
                return
            if len(raw) > budget:
                raw = raw[:budget]
                text = raw.decode("utf-8", errors="ignore")  # drop a multi-byte char cut in half
                budget = 0
                yield f, text
                return
            budget -= len(raw)
        yield f, raw.decode("utf-8", errors="replace")


def source_record(
    sources: Optional[Union[PathLike, Sequence[PathLike]]],
    max_bytes: Optional[int],
    val_fraction: float,
) -> dict[str, Any]:
    """The ``source`` entry :func:`prepare` stores in the sidecars, used to detect stale files.

    ``max_bytes=None`` with ``sources=None`` resolves to :data:`DEFAULT_MAX_BYTES`, as in
    :func:`prepare`; source paths are made absolute.

    Example:
        >>> source_record(None, None, 0.05)
        {'sources': None, 'max_bytes': 4000000, 'val_fraction': 0.05}
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if sources is None and max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES
    return {
        "sources": None if sources is None else [str(Path(s).resolve()) for s in sources],
        "max_bytes": max_bytes,
        "val_fraction": float(val_fraction),
    }


@dataclass(frozen=True)
class PrepareResult:
    """What :func:`prepare` wrote.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> r = prepare(None, tmp.name, max_bytes=5_000)
        >>> r.num_files >= 1 and r.train.num_tokens > r.val.num_tokens
        True
        >>> tmp.cleanup()
    """

    train: TokenFile
    val: TokenFile
    num_files: int
    num_bytes: int


def prepare(
    sources: Optional[Union[PathLike, Sequence[PathLike]]],
    out_dir: PathLike,
    tokenizer: Union[str, Tokenizer] = "byte",
    val_fraction: float = 0.05,
    max_bytes: Optional[int] = None,
    suffixes: Sequence[str] = TEXT_SUFFIXES,
) -> PrepareResult:
    """Tokenize text into ``out_dir/train.bin`` and ``out_dir/val.bin`` (plus sidecars).

    Documents are concatenated in order (separated by the tokenizer's end-of-text id when it
    has one); the last ``val_fraction`` of the tokens become the validation split.

    Args:
        sources: text file(s) and/or directories, or ``None`` for the standard library's
            ``.py`` files (capped at :data:`DEFAULT_MAX_BYTES` unless ``max_bytes`` is given).
        out_dir: directory for the token files (created if needed).
        tokenizer: ``"byte"``, a tiktoken name such as ``"gpt2"``, or a tokenizer object.
        val_fraction: share of tokens for validation, in ``[0, 1)``.
        max_bytes: cap on raw text bytes read (``None``: no cap for user text).
        suffixes: file suffixes taken from directories.

    Raises:
        FileNotFoundError: a source does not exist.
        ValueError: the corpus is empty or an argument is out of range.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> r = prepare(None, tmp.name, max_bytes=20_000, val_fraction=0.1)
        >>> len(r.train) + len(r.val) == r.num_bytes, r.train.tokenizer
        (True, 'byte')
        >>> tmp.cleanup()
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tok = get_tokenizer(tokenizer)
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if sources is not None and len(sources) == 0:
        raise ValueError("no text sources given (pass None for the standard-library corpus)")
    if sources is None and max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES
    parts: list[np.ndarray] = []
    num_files = num_bytes = 0
    eot = tok.eot_id
    for _, text in iter_texts(sources, max_bytes=max_bytes, suffixes=suffixes):
        num_files += 1
        num_bytes += len(text.encode("utf-8"))
        ids = tok.encode_array(text)
        if ids.size:
            parts.append(ids)
            if eot is not None:
                parts.append(np.array([eot], dtype=np.int64))
    if not parts:
        where = "the standard library" if sources is None else [str(s) for s in sources]
        raise ValueError(f"empty corpus: no text found in {where}")
    tokens = np.concatenate(parts)
    n_val = int(round(len(tokens) * val_fraction))
    n_train = len(tokens) - n_val
    source = source_record(sources, max_bytes, val_fraction)
    out = Path(out_dir)
    train = write_tokens(out / "train.bin", tokens[:n_train], tok.vocab_size, tok, extra={"source": source})
    val = write_tokens(out / "val.bin", tokens[n_train:], tok.vocab_size, tok, extra={"source": source})
    return PrepareResult(train=train, val=val, num_files=num_files, num_bytes=num_bytes)
