"""Tokenize the files users have — JSONL / JSON, Parquet, Arrow, CSV, plain text — with a model's own tokenizer,
once, in parallel worker processes, into memory-mapped token files.

Files are read with the Hugging Face ``datasets`` library from local paths only (nothing is downloaded; Arrow
is memory-mapped), tokenized by ``Dataset.map`` in ``num_proc`` worker processes, and streamed into the
package's token files (:class:`~lightning_4d.data.tokens.TokenFile`, ``uint16``/``uint32`` + a JSON sidecar):

- ``data_format="text"``: every document is ``tokenizer(text)`` (with the tokenizer's own special tokens,
  e.g. a BOS) followed by the EOS id; documents are concatenated (packed) into one stream, the last
  ``val_fraction`` of its tokens is the validation split. Batches are windows of ``seq_len`` tokens.
- ``data_format="chat"``: every row is a conversation (``messages``, or ``prompt`` / ``response`` instruction
  fields) encoded with the tokenizer's chat template exactly as ``apply_chat_template`` does, plus a per-token
  mask of the assistant's answers (:func:`~lightning_4d.data.chat.encode_chat`) in ``<split>.mask`` and the
  conversations' start offsets in ``<split>.docs``. A seeded ``val_fraction`` of the conversations is the
  validation split.

``<out_dir>/train.bin`` and ``val.bin`` record the tokenizer that wrote them (name, vocabulary size, special
ids, vocabulary fingerprint) and the *source*: the files (path, size, modification time), the format and its
fields, the split, and a fingerprint of everything in the tokenizer that turns text into ids (chat template
included). :func:`prepare_dataset` returns at once, reading nothing, when the sidecars already record the same
source (``cached=True``); any change re-tokenizes. Every file is written under a temporary name and renamed
into place, sidecar last, so concurrent writers (one per node) and readers are safe. The DataModule
(:class:`~lightning_4d.data.HFDataModule`) runs it in ``prepare_data``, which Lightning calls on one process
per node while the other ranks wait.

Example:
    >>> # not run: needs files (data files, a tokenizer)
    >>> r = prepare_dataset(["chat.jsonl"], "data/chat", "my-model", data_format="chat")  # doctest: +SKIP
    >>> r.cached, r.train.num_tokens, r.tokens_per_second  # doctest: +SKIP
    (False, 18234, 41000.0)
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Optional, Union

import numpy as np

from lightning_4d.data.chat import encode_chats, encode_texts, to_messages
from lightning_4d.data.tokenizer import HFTokenizer, Tokenizer, get_tokenizer
from lightning_4d.data.tokens import TokenFile, TokenWriter

if TYPE_CHECKING:
    from datasets import Dataset
    from numpy.typing import DTypeLike
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DATA_FORMATS",
    "DatasetPrepareResult",
    "DatasetSource",
    "dataset_files",
    "load_rows",
    "open_split",
    "prepare_dataset",
]

PathLike = Union[str, "os.PathLike[str]"]
DATA_FORMATS = ("text", "chat")
"""``text``: packed documents; ``chat``: conversations through the chat template, answers masked."""
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv",
            ".txt": "text", ".text": "text", ".md": "text"}
"""File suffix → ``datasets`` builder."""
SOURCE_VERSION = 1
MIN_ROWS_PER_WORKER = 1000
"""``num_proc=None`` starts one worker per this many rows (at most one per CPU core, at most 8)."""
_WRITE_BATCH = 8192


def _datasets() -> ModuleType:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            "reading JSONL / Parquet / Arrow / text files needs the optional package 'datasets' "
            "(pip install 'lightning_4d[data]' or pip install datasets)"
        ) from err
    return datasets


# ----------------------------------------------------------------------------------------------- files
def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def dataset_files(files: Union[PathLike, Sequence[PathLike]]) -> list[Path]:
    """The files to read, absolute: each file as given; a directory expands to its files with a known suffix
    (``.jsonl .json .parquet .arrow .csv .txt .text .md``, sorted), unless it was written by
    ``Dataset.save_to_disk`` (then it is one entry).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: nothing given, an unknown suffix, a directory without data files, or files of mixed kinds.

    Example:
        >>> dataset_files(["missing.jsonl"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: data file '...missing.jsonl' does not exist
    """
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    out: list[Path] = []
    for entry in files:
        p = Path(entry).absolute()
        if _is_saved_dataset(p) or p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS),
                           key=lambda f: f.relative_to(p).as_posix())
            if not found:
                raise ValueError(f"directory {str(p)!r} holds no data files ({' '.join(BUILDERS)})")
            out.extend(found)
        else:
            raise FileNotFoundError(f"data file {str(p)!r} does not exist")
    if not out:
        raise ValueError("no data files given")
    kinds = {"saved" if _is_saved_dataset(p) else BUILDERS.get(p.suffix) for p in out}
    if None in kinds:
        bad = next(p for p in out if not _is_saved_dataset(p) and p.suffix not in BUILDERS)
        raise ValueError(f"data file {str(bad)!r}: unknown suffix {bad.suffix!r}; use one of {' '.join(BUILDERS)}")
    if len(kinds) > 1:
        raise ValueError(f"data files of different kinds ({', '.join(sorted(map(str, kinds)))}) cannot be read "
                         f"together; convert them to one format")
    return out


def load_rows(files: Sequence[Path], cache_dir: PathLike, text_sample_by: str = "document") -> Dataset:
    """A memory-mapped ``datasets.Dataset`` of the rows of ``files`` (one kind, see :func:`dataset_files`);
    ``datasets``' own Arrow cache goes to ``cache_dir``. Text files give one row per ``text_sample_by``
    (``document``: a whole file; ``paragraph``; ``line``).

    Example:
        >>> # not run: needs files (data files, a tokenizer)
        >>> load_rows(dataset_files(["chat.jsonl"]), "/tmp/cache").column_names  # doctest: +SKIP
        ['messages']
    """
    ds_lib = _datasets()
    if _is_saved_dataset(files[0]):
        parts = [ds_lib.load_from_disk(str(f)) for f in files]
        for f, part in zip(files, parts):
            if not isinstance(part, ds_lib.Dataset):
                raise ValueError(f"{str(f)!r} holds several splits ({', '.join(part)}); pass one split's directory")
        return parts[0] if len(parts) == 1 else ds_lib.concatenate_datasets(parts)
    builder = BUILDERS[files[0].suffix]
    kwargs: dict[str, Any] = {"sample_by": text_sample_by} if builder == "text" else {}
    return ds_lib.load_dataset(builder, data_files=[str(f) for f in files], split="train", cache_dir=str(cache_dir),
                               **kwargs)


# ----------------------------------------------------------------------------------------------- source record
@dataclass(frozen=True)
class DatasetSource:
    """What a prepared dataset is made from and how; its :meth:`record` is stored in the sidecars and decides
    whether :func:`prepare_dataset` must tokenize again.

    Example:
        >>> DatasetSource(files=["a.jsonl"], data_format="chat").fields()["messages_field"]
        'messages'
    """

    files: Sequence[PathLike]
    data_format: str = "text"
    val_files: Optional[Sequence[PathLike]] = None
    val_fraction: float = 0.05
    seed: int = 0
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_prompt: Optional[str] = None
    mask_prompt: bool = True
    text_sample_by: str = "document"

    def __post_init__(self) -> None:
        if self.data_format not in DATA_FORMATS:
            raise ValueError(f"data_format={self.data_format!r} is not one of {', '.join(map(repr, DATA_FORMATS))}")
        if self.val_files is None and not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction} must be in (0, 1) (or give val_files)")
        if self.text_sample_by not in ("document", "paragraph", "line"):
            raise ValueError(f"text_sample_by={self.text_sample_by!r} must be 'document', 'paragraph' or 'line'")

    def fields(self) -> dict[str, Any]:
        """The options that shape the tokens (format-specific)."""
        if self.data_format == "text":
            return {"text_field": self.text_field, "text_sample_by": self.text_sample_by}
        return {"messages_field": self.messages_field, "prompt_field": self.prompt_field,
                "response_field": self.response_field, "system_prompt": self.system_prompt,
                "mask_prompt": self.mask_prompt, "text_sample_by": self.text_sample_by}

    def record(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """JSON-able: files with size and modification time, format, fields, split, tokenizer fingerprints."""
        def stat(paths: Optional[Sequence[PathLike]]) -> Optional[list[list[Union[str, int]]]]:
            if paths is None:
                return None
            out = []
            for f in dataset_files(paths):
                members = sorted(f.rglob("*")) if f.is_dir() else [f]
                out.append([str(f), sum(m.stat().st_size for m in members if m.is_file()),
                            max(m.stat().st_mtime_ns for m in members)])
            return out

        tok: dict[str, Any] = {"name": tokenizer.name, "vocab_size": int(tokenizer.vocab_size)}
        if isinstance(tokenizer, HFTokenizer):  # by content: the same tokenizer saved elsewhere reuses the files
            tok = {"vocab_size": tok["vocab_size"], "vocab_sha256": tokenizer.vocab_sha256,
                   "processing_sha256": tokenizer.processing_sha256}
        return {
            "version": SOURCE_VERSION, "data_format": self.data_format, "files": stat(self.files),
            "val_files": stat(self.val_files), "val_fraction": None if self.val_files else float(self.val_fraction),
            "seed": None if self.val_files or self.data_format == "text" else int(self.seed),
            "fields": self.fields(), "tokenizer": tok,
        }


# ----------------------------------------------------------------------------------------------- result
@dataclass(frozen=True)
class DatasetPrepareResult:
    """What :func:`prepare_dataset` wrote, or found already written (``cached``).

    ``seconds`` and ``tokens_per_second`` measure the tokenization (reading, ``map`` in ``workers`` processes,
    writing); a cached result took no time (``seconds=0``, ``workers=0``).

    Example:
        >>> DatasetPrepareResult(train=None, val=None, cached=True, documents=3, val_documents=1,
        ...                      seconds=0.5, workers=1, tokens=1000).tokens_per_second
        2000.0
    """

    train: TokenFile
    val: Optional[TokenFile]
    cached: bool
    documents: int
    val_documents: int
    seconds: float
    workers: int
    tokens: int

    @property
    def tokens_per_second(self) -> float:
        """Tokens written per second of tokenization (``nan`` for an instant run)."""
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def describe(self) -> str:
        """One line for logs."""
        how = "cached (nothing tokenized)" if self.cached else (
            f"tokenized in {self.seconds:.1f} s by {self.workers} worker process(es): "
            f"{self.tokens_per_second:,.0f} tokens/s")
        val = self.val.num_tokens if self.val is not None else 0
        return (f"data: {self.documents} train / {self.val_documents} val documents, {self.train.num_tokens} / {val} "
                f"tokens in {self.train.path.parent}; {how}")


def _split_path(out_dir: Path, split: str, kind: str = "bin") -> Path:
    return out_dir / f"{split}.{kind}"


def _cached(out_dir: Path, record: Mapping[str, Any]) -> Optional[DatasetPrepareResult]:
    try:
        train, val = TokenFile(_split_path(out_dir, "train")), TokenFile(_split_path(out_dir, "val"))
    except (FileNotFoundError, ValueError):
        return None
    if train.meta.get("source") != record or val.meta.get("source") != record:
        return None
    for f in (train, val):
        for key in ("mask_file", "docs_file"):
            if f.meta.get(key) and not (out_dir / f.meta[key]).is_file():
                return None
    return DatasetPrepareResult(train, val, True, int(train.meta.get("num_documents", 0)),
                                int(val.meta.get("num_documents", 0)), 0.0, 0, train.num_tokens + val.num_tokens)


# ----------------------------------------------------------------------------------------------- tokenizing
def _encode_batch(batch: Mapping[str, list], *, tokenizer: PreTrainedTokenizerBase, source: DatasetSource,
                  eos_id: Optional[int]) -> dict:
    """``Dataset.map`` function (runs in the worker processes): one batch of rows → ``ids`` (and ``mask``)."""
    if source.data_format == "text":
        if source.text_field not in batch:
            raise ValueError(f"the data has no field {source.text_field!r} (fields: {sorted(batch)}); "
                             f"set data.text_field")
        texts = batch[source.text_field]
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise ValueError(f"field {source.text_field!r} holds {type(bad).__name__} values, not text")
        assert eos_id is not None
        return {"ids": encode_texts(tokenizer, texts, eos_id)}
    keys = list(batch)
    conversations = [to_messages(dict(zip(keys, values)), source.messages_field, source.prompt_field,
                                 source.response_field, source.system_prompt) for values in zip(*batch.values())]
    encoded = encode_chats(tokenizer, conversations, mask_prompt=source.mask_prompt)
    return {"ids": [ids for ids, _ in encoded], "mask": [mask for _, mask in encoded]}


def _workers(requested: Optional[int], rows: int) -> int:
    if multiprocessing.current_process().daemon:
        return 1  # a daemonic process (e.g. a test's rank) may not start children
    if requested is not None:
        return max(1, min(int(requested), rows))
    return max(1, min(os.cpu_count() or 1, 8, math.ceil(rows / MIN_ROWS_PER_WORKER)))


@contextmanager
def _no_tokenizer_threads(workers: int) -> Iterator[None]:
    """Worker processes instead of the tokenizer's threads: forking after its thread pool ran would deadlock."""
    if workers <= 1:
        yield
        return
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _tokenize(files: Sequence[Path], source: DatasetSource, tok: HFTokenizer, cache: Path,
              num_proc: Optional[int]) -> tuple[Dataset, int]:
    ds_lib = _datasets()
    rows = load_rows(files, cache, source.text_sample_by)
    if len(rows) == 0:
        raise ValueError(f"no rows in {', '.join(map(str, files))}")
    workers = _workers(num_proc, len(rows))
    value_list = getattr(ds_lib, "List", None) or ds_lib.Sequence
    features = {"ids": value_list(ds_lib.Value("int32"))}
    if source.data_format == "chat":
        features["mask"] = value_list(ds_lib.Value("uint8"))
    with _no_tokenizer_threads(workers):
        mapped = rows.map(
            _encode_batch, batched=True, batch_size=256, num_proc=workers if workers > 1 else None,
            remove_columns=rows.column_names, features=ds_lib.Features(features),
            fn_kwargs={"tokenizer": tok.hf, "source": source, "eos_id": tok.eot_id},
            cache_file_name=str(cache / f"tokens-{uuid.uuid4().hex[:8]}.arrow"), load_from_cache_file=False,
            new_fingerprint=uuid.uuid4().hex, desc="tokenizing",
        )
    return mapped, workers


def _batches(ds: Dataset) -> Iterator[tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
    """(flat ids, per-row lengths, flat mask or None) per batch of rows, straight from Arrow."""
    for table in ds.with_format("arrow").iter(batch_size=_WRITE_BATCH):
        col = table.column("ids").combine_chunks()
        ids = col.flatten().to_numpy(zero_copy_only=False)
        lengths = col.value_lengths().to_numpy(zero_copy_only=False)
        mask = None
        if "mask" in table.column_names:
            mask = table.column("mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        yield ids, lengths, mask


class _RawWriter:
    """A flat binary array (``dtype``) written under a temporary name, renamed into place on success."""

    def __init__(self, path: Path, dtype: DTypeLike) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        self.fh: BinaryIO = open(self.tmp, "wb")

    def write(self, values: np.ndarray) -> None:
        self.fh.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())

    def __enter__(self) -> "_RawWriter":
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        elif self.tmp.exists():
            self.tmp.unlink()


def _write_chat(ds: Dataset, out_dir: Path, split: str, tok: HFTokenizer, extra: dict[str, Any]) -> TokenFile:
    mask_path, docs_path = _split_path(out_dir, split, "mask"), _split_path(out_dir, split, "docs")
    meta = {**extra, "mask_file": mask_path.name, "docs_file": docs_path.name}
    with TokenWriter(_split_path(out_dir, split), tok.vocab_size, tok, meta) as writer, \
            _RawWriter(mask_path, np.uint8) as masks, _RawWriter(docs_path, np.int64) as docs:
        start, count, trained = 0, 0, 0
        docs.write(np.zeros(1, dtype=np.int64))
        for ids, lengths, mask in _batches(ds):
            writer.write(ids)
            assert mask is not None and mask.shape == ids.shape
            masks.write(mask)
            trained += int(mask.sum())
            ends = start + np.cumsum(lengths, dtype=np.int64)
            docs.write(ends)
            start = int(ends[-1]) if len(ends) else start
            count += len(lengths)
        writer.meta.update(num_documents=count, answer_tokens=trained)
    assert writer.result is not None
    return writer.result


def _write_text(ds: Dataset, out_dir: Path, tok: HFTokenizer, extra: dict[str, Any], val_fraction: Optional[float],
                split: str = "train") -> tuple[TokenFile, Optional[TokenFile]]:
    """One packed stream into ``<split>.bin``; with ``val_fraction`` its last tokens go to ``val.bin``. Sidecars
    count the documents with a token in each file (one cut by the split counts in both)."""
    total = sum(int(lengths.sum()) for _, lengths, _ in _batches(ds))
    n_val = int(round(total * val_fraction)) if val_fraction else 0
    n_first = total - n_val
    first = TokenWriter(_split_path(out_dir, split), tok.vocab_size, tok, extra)
    second = TokenWriter(_split_path(out_dir, "val"), tok.vocab_size, tok, extra) if val_fraction else None
    written, docs_first, docs_second = 0, 0, 0
    try:
        for ids, lengths, _ in _batches(ds):
            cut = min(max(n_first - written, 0), len(ids))
            first.write(ids[:cut])
            if second is not None:
                second.write(ids[cut:])
            ends = written + np.cumsum(lengths, dtype=np.int64)
            starts = ends - lengths
            docs_first += int((starts < n_first).sum())
            docs_second += int((ends > n_first).sum())
            written += len(ids)
        first.meta["num_documents"] = docs_first
        if second is not None:
            second.meta["num_documents"] = docs_second
            second.close()
        result = first.close()
    except BaseException:
        first.abort()
        if second is not None:
            second.abort()
        raise
    return result, second.result if second is not None else None


def prepare_dataset(
    files: Union[PathLike, Sequence[PathLike]],
    out_dir: PathLike,
    tokenizer: Union[str, PathLike, HFTokenizer],
    data_format: str = "text",
    *,
    val_files: Optional[Union[PathLike, Sequence[PathLike]]] = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    text_field: str = "text",
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    response_field: str = "response",
    system_prompt: Optional[str] = None,
    mask_prompt: bool = True,
    text_sample_by: str = "document",
    num_proc: Optional[int] = None,
) -> DatasetPrepareResult:
    """Tokenize ``files`` (and ``val_files``) with ``tokenizer`` into ``out_dir`` — unless the files there were
    made from the same source, then nothing is read (``cached=True``). See the module docstring.

    Args:
        files: data files or directories (see :func:`dataset_files`).
        out_dir: where ``train.bin`` / ``val.bin`` (+ sidecars, and ``.mask`` / ``.docs`` for chat) go.
        tokenizer: a Hugging Face tokenizer directory (the model's) or an :class:`HFTokenizer`.
        data_format: ``"text"`` or ``"chat"``.
        val_files: a separate validation set (then ``val_fraction`` is not used).
        val_fraction: share of tokens (text) or of conversations (chat, picked with ``seed``) for validation.
        seed: seed of the chat validation pick.
        text_field: the column holding text (``text`` format).
        messages_field: the column holding a conversation (``chat``).
        prompt_field, response_field: instruction columns used when a row has no ``messages_field`` (``chat``).
        system_prompt: a system turn added to conversations that have none (``chat``).
        mask_prompt: train on the answers only (``chat``); ``False``: on every token.
        text_sample_by: rows of text files: ``document`` (a file), ``paragraph`` or ``line``.
        num_proc: worker processes; ``None``: one per 1000 rows, at most one per CPU core and 8.

    Raises:
        FileNotFoundError, ValueError, ChatTemplateError: missing files, wrong fields, a tokenizer without the
            EOS (text) or chat template (chat) the format needs.

    Example:
        >>> # not run: needs files (data files, a tokenizer)
        >>> prepare_dataset("notes/", "data/notes", "my-model", data_format="text").cached  # doctest: +SKIP
        False
    """
    tok = tokenizer if isinstance(tokenizer, HFTokenizer) else get_tokenizer(tokenizer)
    if not isinstance(tok, HFTokenizer):
        raise ValueError(f"tokenizer {tokenizer!r}: prepare_dataset needs a Hugging Face tokenizer directory (the "
                         f"model's own); for the byte or tiktoken tokenizers use lightning_4d.data.prepare")
    source = DatasetSource(
        files=[str(f) for f in dataset_files(files)], data_format=data_format,
        val_files=[str(f) for f in dataset_files(val_files)] if val_files is not None else None,
        val_fraction=val_fraction, seed=seed, text_field=text_field, messages_field=messages_field,
        prompt_field=prompt_field, response_field=response_field, system_prompt=system_prompt,
        mask_prompt=mask_prompt, text_sample_by=text_sample_by)
    if data_format == "text" and tok.eot_id is None:
        raise ValueError(f"tokenizer {tok.name!r} has no eos_token, so packed documents could not be separated; "
                         f"set tokenizer.eos_token and save_pretrained, or use data_format='chat'")
    out = Path(out_dir).absolute()
    record = source.record(tok)
    found = _cached(out, record)
    if found is not None:
        return found
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix=".datasets-", dir=out))
    start = time.perf_counter()
    try:
        mapped, workers = _tokenize([Path(f) for f in source.files], source, tok, cache / "train", num_proc)
        val_mapped = None
        if source.val_files is not None:
            val_mapped, _ = _tokenize([Path(f) for f in source.val_files], source, tok, cache / "val", num_proc)
        extra = {"source": record, "data_format": data_format, "pad_id": _pad_id(tok)}
        if data_format == "chat":
            if val_mapped is None:
                mapped, val_mapped = _pick_validation(mapped, val_fraction, seed)
            val = _write_chat(val_mapped, out, "val", tok, extra)  # train last: its sidecar marks the whole
            train = _write_chat(mapped, out, "train", tok, extra)
        elif val_mapped is not None:
            val, _ = _write_text(val_mapped, out, tok, extra, None, split="val")
            train, _ = _write_text(mapped, out, tok, extra, None)
        else:
            train, val = _write_text(mapped, out, tok, extra, val_fraction)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    assert val is not None
    return DatasetPrepareResult(train, val, False, int(train.meta["num_documents"]), int(val.meta["num_documents"]),
                                seconds, workers, train.num_tokens + val.num_tokens)


def _pick_validation(mapped: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(train, validation) conversations: a seeded ``val_fraction`` of them (at least one each) for validation."""
    n = len(mapped)
    if n < 2:
        raise ValueError(f"{n} conversation(s): a validation split needs at least 2; add data or give val_files")
    n_val = min(max(int(round(n * val_fraction)), 1), n - 1)
    picked = np.sort(np.random.default_rng(seed).permutation(n)[:n_val])
    return mapped.select(np.setdiff1d(np.arange(n), picked)), mapped.select(picked)


def _pad_id(tok: HFTokenizer) -> int:
    """Filler for rows shorter than ``seq_len`` (their targets are ignored): pad, else EOS, else 0."""
    for value in (tok.hf.pad_token_id, tok.eot_id):
        if value is not None:
            return int(value)
    return 0


def open_split(out_dir: PathLike, split: str) -> tuple[TokenFile, Optional[np.ndarray], Optional[np.ndarray]]:
    """A prepared split: its :class:`TokenFile`, the answer mask (``uint8``, chat) and the conversations' start
    offsets with the end appended (``int64``, chat), both memory-mapped; ``None`` for text.

    Example:
        >>> # not run: needs files (data files, a tokenizer)
        >>> tokens, mask, docs = open_split("data/chat", "train")  # doctest: +SKIP
        >>> int(mask.sum()), len(docs) - 1  # doctest: +SKIP
        (5120, 64)
    """
    out = Path(out_dir)
    tf = TokenFile(_split_path(out, split))
    mask = docs = None
    if tf.meta.get("mask_file"):
        mask = _memmap(out / tf.meta["mask_file"], np.uint8, tf.num_tokens)
    if tf.meta.get("docs_file"):
        n = int(tf.meta.get("num_documents", 0)) + 1
        docs = _memmap(out / tf.meta["docs_file"], np.int64, n)
    return tf, mask, docs


def _memmap(path: Path, dtype: DTypeLike, count: int) -> np.ndarray:
    size = path.stat().st_size if path.is_file() else -1
    if size != count * np.dtype(dtype).itemsize:
        raise ValueError(f"{str(path)!r} has {size} bytes, but its token file's sidecar implies "
                         f"{count * np.dtype(dtype).itemsize}; prepare the data again")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
