"""Streamed export: read a DCP checkpoint one tensor at a time, write safetensors files one tensor at a time.

:class:`CheckpointReader` lists every model tensor of a checkpoint (name, global shape, dtype) from DCP's
``.metadata`` alone and reads one tensor at a time (``torch.distributed.checkpoint.load`` of that key into an
empty tensor, no process group): only the tensor and one of its saved chunks are in memory (DCP's reader
deserialises a chunk, then copies it into place: about twice the tensor when it was saved whole).

:class:`SafetensorsWriter` writes files whose layout — which tensors, their shapes and dtypes, in which file —
is known before any weight is read (:func:`plan_shards` splits it like Hugging Face's ``save_pretrained``:
``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``). Each
file's header is written first, each tensor goes to its offset as it arrives, in any order; the bytes equal
``safetensors.torch.save_file``'s for the same tensors. Closing checks that every planned tensor was written
and reads every header back.

Example:
    >>> # not run: needs files (a checkpoint, an output directory)
    >>> reader = CheckpointReader("ckpts/last.ckpt")  # doctest: +SKIP
    >>> layout = plan_shards(reader.specs, "5GB")  # doctest: +SKIP
    >>> with SafetensorsWriter("out", layout) as writer:  # doctest: +SKIP
    ...     for name in reader.specs:
    ...         writer.write(name, reader.read(name))
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable, Iterator, Mapping, Optional, Union

import torch
from torch.distributed.checkpoint import FileSystemReader

if TYPE_CHECKING:
    from types import TracebackType

    from torch.distributed.checkpoint import Metadata

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "SAFE_WEIGHTS_INDEX", "SAFE_WEIGHTS_PATTERN", "CheckpointReader",
           "SafetensorsWriter", "TensorSpec", "atomic_directory", "check_new_directory", "parse_size", "plan_shards",
           "write_index"]

PathLike = Union[str, "os.PathLike[str]"]

DEFAULT_MAX_SHARD_SIZE = "50GB"
"""Largest output file before the export is split into shards (``save_pretrained``'s default)."""
SAFE_WEIGHTS_PATTERN = "model{suffix}.safetensors"
"""File names of an export: ``model.safetensors``, or ``model-00001-of-00003.safetensors``, ... when sharded."""
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
"""The index ``from_pretrained`` reads for a sharded export (``weight_map``: tensor name → file)."""

# safetensors' dtype names, in the order of its Rust ``Dtype`` enum: a file stores tensors by that order
# (descending), then by name, so that every tensor's bytes stay aligned.
_ST_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
             "F64", "I64", "U64")
_ST_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
             torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
             torch.complex64: "C64", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor not read yet.

    Example:
        >>> TensorSpec((2, 3), torch.bfloat16).nbytes
        12
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        """The spec of ``tensor`` (meta tensors too).

        Example:
            >>> TensorSpec.of(torch.empty(2, 3, device="meta"))
            TensorSpec(shape=(2, 3), dtype=torch.float32)
        """
        return cls(tuple(tensor.shape), tensor.dtype)

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


def parse_size(size: Union[int, str]) -> int:
    """Bytes of a size given as an int or a string: ``"5GB"`` (10^9), ``"500MB"``, ``"2GiB"`` (2^30), ``"1e9"``.

    Example:
        >>> parse_size("5GB"), parse_size("2KiB"), parse_size(100)
        (5000000000, 2048, 100)
        >>> parse_size("five")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: max_shard_size='five' is not a size: use bytes (an int) or a number with a unit, ...
    """
    value: float
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
        if match is None:
            raise ValueError(f"max_shard_size={size!r} is not a size: use bytes (an int) or a number with a unit, "
                             f"e.g. '5GB' or '500MB'.")
        value = float(match[1]) * _UNITS[(match[2] or "").upper()]
    if value < 1:
        raise ValueError(f"max_shard_size={size!r} must be at least one byte, e.g. '5GB'.")
    return int(value)


def plan_shards(specs: Mapping[str, TensorSpec], max_shard_size: Union[int, str, None] = DEFAULT_MAX_SHARD_SIZE,
                pattern: str = SAFE_WEIGHTS_PATTERN) -> dict[str, dict[str, TensorSpec]]:
    """Assign tensors to files, in order, like ``save_pretrained`` (``huggingface_hub``'s rule): a file takes
    tensors until the next one would make it larger than ``max_shard_size``; a tensor larger than that gets a
    file of its own. One file is named ``pattern.format(suffix="")``, several ``-0000k-of-0000n``.
    ``max_shard_size=None``: one file.

    Example:
        >>> specs = {n: TensorSpec((10,), torch.float32) for n in "abc"}
        >>> {f: list(t) for f, t in plan_shards(specs, 80).items()}
        {'model-00001-of-00002.safetensors': ['a', 'b'], 'model-00002-of-00002.safetensors': ['c']}
        >>> list(plan_shards(specs, None))
        ['model.safetensors']
    """
    limit = math.inf if max_shard_size is None else parse_size(max_shard_size)
    shards: list[dict[str, TensorSpec]] = []
    current: dict[str, TensorSpec] = {}
    size = 0
    for name, spec in specs.items():
        if spec.nbytes > limit:
            shards.append({name: spec})
            continue
        if current and size + spec.nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = spec
        size += spec.nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return {pattern.format(suffix=""): shards[0]}
    return {pattern.format(suffix=f"-{i + 1:05d}-of-{len(shards):05d}"): shard for i, shard in enumerate(shards)}


def write_index(directory: PathLike, layout: Mapping[str, Mapping[str, TensorSpec]],
                total_parameters: Optional[int] = None, name: str = SAFE_WEIGHTS_INDEX) -> Path:
    """Write the shard index ``save_pretrained`` writes (``metadata.total_size``, ``weight_map``) and return it.

    Example:
        >>> layout = {"model-00001-of-00001.safetensors": {"w": TensorSpec((2,), torch.float32)}}
        >>> # not run: needs files (a checkpoint, an output directory)
        >>> write_index("out", layout)  # doctest: +SKIP
        PosixPath('out/model.safetensors.index.json')
    """
    metadata: dict[str, int] = {"total_size": sum(s.nbytes for specs in layout.values() for s in specs.values())}
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    index = {"metadata": metadata, "weight_map": {t: f for f, specs in layout.items() for t in specs}}
    path = Path(directory) / name
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def _st_dtype(name: str, dtype: torch.dtype) -> str:
    if dtype not in _ST_NAMES:
        raise ValueError(f"{name} has dtype {dtype}, which safetensors cannot store: cast it (e.g. dtype='float32').")
    return _ST_NAMES[dtype]


class _File:
    """One output file: its header, every tensor's byte range, and what is still to be written."""

    def __init__(self, path: Path, specs: Mapping[str, TensorSpec], metadata: Optional[Mapping[str, str]]) -> None:
        self.path = path
        self.specs = dict(specs)
        order = sorted(specs, key=lambda n: (-_ST_ORDER.index(_st_dtype(n, specs[n].dtype)), n))
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self.ranges: dict[str, tuple[int, int]] = {}
        for name in order:
            end = offset + specs[name].nbytes
            header[name] = {"dtype": _ST_NAMES[specs[name].dtype], "shape": list(specs[name].shape),
                            "data_offsets": [offset, end]}
            self.ranges[name] = (offset, end)
            offset = end
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # as safetensors: the data starts 8-byte aligned
        self.header = struct.pack("<Q", len(blob)) + blob
        self.size = len(self.header) + offset
        self.remaining = set(specs)
        self.handle: Optional[BinaryIO] = None

    def open(self) -> BinaryIO:
        if self.handle is None:
            self.handle = open(self.path, "wb")
            self.handle.write(self.header)
            self.handle.truncate(self.size)
        return self.handle

    def finish(self) -> None:
        handle = self.open()
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        self.handle = None


class SafetensorsWriter:
    """Write safetensors files of a known layout (file → tensor name → :class:`TensorSpec`), one tensor at a
    time, in any order; memory ≈ the tensor being written.

    Every tensor must match its planned shape and dtype (``ValueError`` naming it otherwise), and each is
    written once. :meth:`close` fails naming the tensors never written, then reads every header back with
    ``safetensors.safe_open`` and compares names, shapes and dtypes with the plan.

    Example:
        >>> layout = {"model.safetensors": {"w": TensorSpec((2,), torch.float32)}}
        >>> # not run: needs files (a checkpoint, an output directory)
        >>> with SafetensorsWriter("out", layout) as writer:  # doctest: +SKIP
        ...     writer.write("w", torch.ones(2))
    """

    def __init__(self, directory: PathLike, layout: Mapping[str, Mapping[str, TensorSpec]],
                 metadata: Optional[Mapping[str, str]] = None) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors files are little-endian; export on a little-endian machine.")
        self.directory = Path(directory)
        meta = {"format": "pt"} if metadata is None else metadata
        self.files = {name: _File(self.directory / name, specs, meta) for name, specs in layout.items()}
        self.where = {tensor: name for name, specs in layout.items() for tensor in specs}
        if len(self.where) != sum(len(specs) for specs in layout.values()):
            raise ValueError("a tensor name is planned in two files; each name must appear once.")
        self.written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (CPU) as ``name`` at its place in its file.

        Example:
            >>> # not run: needs files (a checkpoint, an output directory)
            >>> writer.write("model.norm.weight", torch.ones(64))  # doctest: +SKIP
        """
        if name not in self.where:
            raise ValueError(f"{name} is not in the planned export: the plan and the tensors disagree (a bug, "
                             f"please report it with the model's config).")
        if name in self.written:
            raise ValueError(f"{name} was written twice: each tensor of an export is written once.")
        file = self.files[self.where[name]]
        spec, got = file.specs[name], TensorSpec.of(tensor)
        if got != spec:
            raise ValueError(f"{name} is {got}, the plan says {spec}: the checkpoint and the model's config disagree.")
        start, end = file.ranges[name]
        if end > start:
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            handle = file.open()
            handle.seek(len(file.header) + start)
            handle.write(memoryview(data.numpy()))
        self.written.add(name)
        file.remaining.discard(name)
        if not file.remaining:
            file.finish()

    def close(self) -> list[Path]:
        """Finish every file and check it; return the files written.

        Example:
            >>> # not run: needs files (a checkpoint, an output directory)
            >>> writer.close()  # doctest: +SKIP
            [PosixPath('out/model.safetensors')]
        """
        missing = sorted(set(self.where) - self.written)
        if missing:
            self.abort()
            raise ValueError(f"{len(missing)} planned tensors were never written ({', '.join(missing[:6])}): the "
                             f"export is incomplete and was not kept.")
        for file in self.files.values():
            if file.handle is not None or not file.path.exists():
                file.finish()
        _check_files(self.files.values())
        return [file.path for file in self.files.values()]

    def abort(self) -> None:
        """Close every open file without checking (the caller removes the partial output)."""
        for file in self.files.values():
            if file.handle is not None:
                file.handle.close()
                file.handle = None

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def _check_files(files: Iterable[_File]) -> None:
    """Read every written header back and compare it with the plan (names, shapes, dtypes, sizes)."""
    from safetensors import safe_open

    for file in files:
        if file.path.stat().st_size != file.size:
            raise ValueError(f"{file.path} has {file.path.stat().st_size} bytes, {file.size} were planned: the disk "
                             f"may be full.")
        with safe_open(str(file.path), "pt") as handle:
            names = set(handle.keys())
            if names != set(file.specs):
                raise ValueError(f"{file.path} holds {sorted(names ^ set(file.specs))[:6]} against the plan.")
            for name in names:
                piece = handle.get_slice(name)
                shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                spec = file.specs[name]
                if shape != spec.shape or dtype != _ST_NAMES[spec.dtype]:
                    raise ValueError(f"{file.path}: {name} reads back as {shape} {dtype}, planned {spec}.")


class CheckpointReader:
    """The model tensors of a DCP checkpoint, read one at a time without a process group.

    ``specs`` maps each tensor's name (without the ``"model."`` key prefix of the checkpoint) to its global
    shape and dtype, from DCP's ``.metadata`` alone; :meth:`read` reads one tensor in full (any layout it was
    saved in: DTensor or FSDP shards are assembled from their chunks). A tensor whose saved chunks do not
    cover it is refused when the reader is made.

    Example:
        >>> # not run: needs files (a checkpoint, an output directory)
        >>> reader = CheckpointReader("ckpts/last.ckpt")  # doctest: +SKIP
        >>> reader.read("model.layers.0.attention.wq.weight").shape  # doctest: +SKIP
        torch.Size([32, 32])
    """

    def __init__(self, checkpoint: PathLike, prefix: str = "model.") -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(checkpoint)
        self.prefix = prefix
        try:
            metadata = FileSystemReader(str(self.path)).read_metadata()
        except Exception as err:
            raise ValueError(f"{self.path / '.metadata'} is damaged: {type(err).__name__}: {err}.") from err
        self._storage = _CachedMetadataReader(str(self.path), metadata)
        self.specs: dict[str, TensorSpec] = {}
        uncovered: list[str] = []
        for key, meta in metadata.state_dict_metadata.items():
            if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
                continue
            spec = TensorSpec(tuple(meta.size), meta.properties.dtype)
            self.specs[key[len(prefix):]] = spec
            if sum(math.prod(chunk.sizes) for chunk in meta.chunks) < spec.numel:
                uncovered.append(key)
        if uncovered:
            raise ValueError(f"Could not read checkpoint {self.path}: the saved shards of {', '.join(uncovered[:4])} "
                             f"do not cover the whole tensor; the checkpoint is incomplete, use another one.")

    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (CPU, its saved dtype).

        Example:
            >>> # not run: needs files (a checkpoint, an output directory)
            >>> reader.read("model.norm.weight")  # doctest: +SKIP
            tensor([1., 1., ...])
        """
        import torch.distributed.checkpoint as dcp

        spec = self.specs[name]
        out = torch.empty(spec.shape, dtype=spec.dtype)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({self.prefix + name: out}, storage_reader=self._storage, no_dist=True)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
            detail = " ".join(str(err).split())
            missing = re.search(r"No such file or directory: '([^']+)'", detail)
            cause = f"{missing.group(1)} is missing" if missing else detail[:300]
            raise ValueError(f"Could not read checkpoint {self.path}: {cause}.") from err
        return out

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0 of tensor ``name`` (e.g. experts of a stacked expert tensor), reading
        only the saved chunks that hold them (a checkpoint saved under ep > 1 holds experts in separate chunks).

        Example:
            >>> # not run: needs files (a checkpoint)
            >>> reader.read_rows("layers.0.mlp.experts.gate_up_proj", 3, 4).shape  # doctest: +SKIP
            torch.Size([1, 128, 32])
        """
        import torch.distributed.checkpoint as dcp

        spec = self.specs[name]
        if not 0 <= start < stop <= spec.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) are outside {name}'s {spec.shape[0]} rows.")
        out = torch.empty((stop - start, *spec.shape[1:]), dtype=spec.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({self.prefix + name: out}, storage_reader=self._storage,
                     planner=_rows_planner(self.prefix + name, start, stop), no_dist=True)
        return out


def _rows_planner(fqn: str, start: int, stop: int) -> Any:
    """A DCP ``LoadPlanner`` that reads rows ``[start, stop)`` (dim 0) of tensor ``fqn`` into a tensor holding
    just those rows: one ``ReadItem`` per saved chunk that intersects them (other chunks are not read)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    class RowsPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for chunk in self.metadata.state_dict_metadata[fqn].chunks:
                lo, hi = max(start, chunk.offsets[0]), min(stop, chunk.offsets[0] + chunk.sizes[0])
                if lo >= hi:
                    continue
                dest = torch.Size([lo - start, *chunk.offsets[1:]])
                items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, dest), dest_offsets=dest,
                                      storage_index=MetadataIndex(fqn, chunk.offsets),
                                      storage_offsets=torch.Size([lo - chunk.offsets[0], *[0] * (len(dest) - 1)]),
                                      lengths=torch.Size([hi - lo, *chunk.sizes[1:]])))
            return LoadPlan(items)

    return RowsPlanner()


class _CachedMetadataReader(FileSystemReader):
    """``FileSystemReader`` returning metadata read once (``dcp.load`` reads ``.metadata`` on every call)."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


@contextlib.contextmanager
def atomic_directory(out: PathLike) -> Iterator[Path]:
    """Yield ``<out>.partial`` (new, empty) to write an export into; renamed to ``out`` when the block ends
    without an error, removed when it raises. ``out`` must not exist or be an empty directory.

    Example:
        >>> # not run: needs files (a checkpoint, an output directory)
        >>> with atomic_directory("exported") as tmp:  # doctest: +SKIP
        ...     (tmp / "config.json").write_text("{}")
    """
    target = Path(out)
    check_new_directory(target)
    tmp = target.with_name(target.name + ".partial")
    if os.path.lexists(tmp):
        shutil.rmtree(tmp) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink()
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        target.rmdir()  # empty (checked above)
    os.replace(tmp, target)  # never a half-written directory under the final name


def check_new_directory(out: PathLike) -> None:
    """Raise ``ValueError`` unless ``out`` is absent or an empty directory.

    Example:
        >>> check_new_directory("surely/not/there")
    """
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty directory: choose a new output directory or "
                         f"remove it first.")
