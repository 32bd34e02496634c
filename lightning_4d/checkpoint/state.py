"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), keyed by original names.

A checkpoint is a directory: DCP shards of the model and optimizer state (each rank writes only
its shards), each rank's random states, ``meta.pt`` with Lightning's loop state, ``manifest.json``
(size and SHA-256 of every file) and the ``.complete`` marker, written by rank 0 last.

Crash-safe swap. The directory is written as ``<path>.partial``; when complete it replaces ``<path>``
in two renames (``<path>`` → ``<path>.old``, ``<path>.partial`` → ``<path>``), then ``<path>.old`` is
removed (its marker first, so a half-removed directory never looks complete). Interrupted at any file
operation, one of these holds a complete checkpoint: ``<path>``; or, between the two renames, both
``<path>.partial`` (new) and ``<path>.old`` (previous). :func:`recover_checkpoint` puts the newest
complete one back at ``<path>``; every save and every load calls it first, and a save then removes any
leftover ``.partial`` / ``.old``.

Example:
    >>> # not run: needs files (a checkpoint)
    >>> save_sharded(checkpoint, "ckpts/step=10.ckpt", is_global_zero=True)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.optim import Optimizer

__all__ = ["model_state_dict", "optimizer_state_dict", "save_sharded", "load_sharded", "is_checkpoint",
           "check_checkpoint", "recover_checkpoint", "verify_checkpoint", "CheckpointIntegrityError",
           "CheckpointSaveError", "META_FILE", "MANIFEST_FILE"]

META_FILE = "meta.pt"
MANIFEST_FILE = "manifest.json"
_COMPLETE = ".complete"
_REQUIRED = (_COMPLETE, META_FILE, ".metadata")  # what every complete checkpoint directory holds
_HASH_CHUNK = 8 << 20


class CheckpointIntegrityError(ValueError):
    """A checkpoint file is missing, truncated or damaged (its size or checksum differs from the manifest)."""


def _options(optimizer: bool = False) -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened optimizer keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") do not depend on which
    # parameters a rank holds, so pipeline stages and any resharding load them.
    return StateDictOptions(full_state_dict=False, cpu_offload=False, flatten_optimizer_state_dict=optimizer)


def _perms(model: nn.Module) -> dict[str, tuple[list[int], int]]:
    from lightning_4d.tensor_parallel.layouts import permutations_of

    return permutations_of(model)


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's shards of the model state, keyed by the original parameter names, in the user's own
    layout (fused projections that tensor parallelism permuted are stored unpermuted).

    Example:
        >>> sorted(model_state_dict(nn.Linear(1, 1)))
        ['bias', 'weight']
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lightning_4d.tensor_parallel.layouts import canonical_state

    return canonical_state(get_model_state_dict(model, options=_options()), _perms(model))


def _unwrap_optimizer(optimizer: Union[Optimizer, LightningOptimizer]) -> Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (any other object unchanged)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_state_dict(model: nn.Module, optimizer: Union[Optimizer, LightningOptimizer]) -> dict[str, Any]:
    """This rank's shards of the optimizer state, keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_4d.tensor_parallel.layouts import canonical_state

    optimizer = _unwrap_optimizer(optimizer)
    return canonical_state(get_optimizer_state_dict(model, optimizer, options=_options(optimizer=True)), _perms(model))


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory.

    Example:
        >>> is_checkpoint("does/not/exist")
        False
    """
    p = Path(path)
    return p.is_dir() and (p / _COMPLETE).exists() and (p / META_FILE).exists()


def check_checkpoint(path: str | os.PathLike) -> Path:
    """Raise a clear error unless ``path`` is a complete sharded checkpoint.

    Example:
        >>> check_checkpoint("nowhere")
        Traceback (most recent call last):
        ...
        FileNotFoundError: nowhere is not a lightning_4d checkpoint: no such directory.
    """
    p = Path(path)
    if p.is_file():
        hint = (" It looks like a consolidated export: load it with "
                "lightning_4d.checkpoint.import_consolidated(module, path) before fit." if p.suffix == ".safetensors"
                else " A single-file checkpoint of another strategy cannot be resumed by FourDStrategy; pass the "
                     "directory FourDStrategy wrote (e.g. checkpoints/step=100.ckpt/).")
        raise FileNotFoundError(
            f"{path} is a file, not a lightning_4d checkpoint: FourDStrategy writes each checkpoint as a directory "
            f"(sharded files, a manifest and a '{_COMPLETE}' marker).{hint}")
    if not p.is_dir():
        sibling = _complete_sibling(p)
        if sibling is not None:
            raise FileNotFoundError(
                f"{path} does not exist, but {sibling} holds a complete checkpoint left by a save interrupted "
                f"while swapping directories. Loading it with the Trainer (`fit(ckpt_path=...)`) or "
                f"`recover_checkpoint({str(path)!r})` moves it back to {path}."
            )
        raise FileNotFoundError(f"{path} is not a lightning_4d checkpoint: no such directory.")
    if p.name.endswith(".partial"):
        raise ValueError(f"{path} is an interrupted save (a '.partial' directory); use the previous checkpoint.")
    for required in _REQUIRED:
        if not (p / required).exists():
            raise FileNotFoundError(
                f"{path} is not a complete lightning_4d checkpoint: {p / required} is missing (interrupted or "
                f"foreign directory)."
            )
    return p


# ------------------------------------------------------------------ file operations of a save
def _file_op(kind: str, fn: Callable[..., None], *args: Union[Path, bytes]) -> None:
    """Run one file operation of a save or recovery (``kind``: mkdir, write, replace, unlink, rmtree).

    Every operation that changes what lies at or beside a checkpoint's path goes through here, so
    tests can interrupt a save at each one.
    """
    return fn(*args)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make renames inside ``path`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace(src: Path, dst: Path) -> None:
    _file_op("replace", os.replace, src, dst)
    _fsync_dir(dst.parent)


def _remove(path: Path) -> None:
    """Remove a checkpoint directory, its completion marker first (half removed, it never looks complete)."""
    if path.is_dir() and not path.is_symlink():
        if (path / _COMPLETE).exists():
            _file_op("unlink", os.unlink, path / _COMPLETE)
        _file_op("rmtree", shutil.rmtree, path)
    elif os.path.lexists(path):
        _file_op("unlink", os.unlink, path)


def _siblings(final: Path) -> tuple[Path, Path]:
    """``<path>.partial`` (the save in progress) and ``<path>.old`` (the previous one, during the swap)."""
    return final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")


def _complete_sibling(final: Path) -> Optional[Path]:
    partial, old = _siblings(final)
    return next((p for p in (partial, old) if is_checkpoint(p)), None)


def recover_checkpoint(path: str | os.PathLike) -> Optional[Path]:
    """Finish a swap a crash interrupted; return the directory moved back to ``path`` (``None``: none).

    When ``path`` is missing, its newest complete sibling (``<path>.partial``, else ``<path>.old``) is
    renamed to ``path``; a ``<path>.old`` left beside a complete ``path`` is removed. Saves and loads call
    it (on one process) before anything else.

    Example:
        >>> recover_checkpoint("does/not/exist") is None
        True
    """
    final = Path(path)
    _, old = _siblings(final)
    moved = None
    if not os.path.lexists(final):
        moved = _complete_sibling(final)
        if moved is None:
            return None
        _replace(moved, final)
    if os.path.lexists(old) and is_checkpoint(final):
        _remove(old)
    return moved


# ------------------------------------------------------------------ manifest
def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        if hasattr(hashlib, "file_digest"):  # Python 3.11+: reads into one reused buffer (~1.3x faster)
            return hashlib.file_digest(f, "sha256").hexdigest()
        digest = hashlib.sha256()
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
        return digest.hexdigest()


def _file_entries(directory: Path, names: Iterable[str], checksums: bool) -> dict[str, dict[str, Any]]:
    return {name: {"bytes": (directory / name).stat().st_size,
                   "sha256": _sha256_file(directory / name) if checksums else None} for name in names}


def _digest(files: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _manifest_bytes(files: dict[str, Any], checksums: bool) -> bytes:
    body = {"format": "lightning_4d checkpoint manifest", "version": 1, "algorithm": "sha256" if checksums else None,
            "files": files, "digest": _digest(files)}
    return json.dumps(body, indent=1, sort_keys=True).encode()


def _read_manifest(path: Path) -> Optional[dict[str, Any]]:
    file = path / MANIFEST_FILE
    if not file.exists():
        return None  # written before manifests existed: nothing to verify against
    try:
        body = json.loads(file.read_bytes().decode("utf-8"))
        files = body["files"]
        intact = body.get("digest") == _digest(files)
    except (ValueError, KeyError, TypeError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointIntegrityError(
            f"{file} is damaged (not a readable manifest: {type(err).__name__}); the checkpoint cannot be verified."
        ) from err
    if not intact:
        raise CheckpointIntegrityError(f"{file} is damaged: its digest does not match the file list it holds.")
    return body


def _check_file(path: Path, name: str, entry: dict[str, Any], checksums: bool) -> Optional[str]:
    file = path / name
    if not file.is_file():
        return f"{file} is missing (listed in {MANIFEST_FILE})"
    size = file.stat().st_size
    if size != entry.get("bytes"):
        return f"{file} is damaged or truncated: {size} bytes, {MANIFEST_FILE} records {entry.get('bytes')}"
    want = entry.get("sha256")
    if checksums and want:
        got = _sha256_file(file)
        if got != want:
            return (f"{file} is damaged: its SHA-256 {got[:12]}… differs from {want[:12]}… recorded when it was "
                    f"written (disk, transfer or copy corruption)")
    return None


def verify_checkpoint(path: str | os.PathLike, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> int:
    """Check the files of ``path`` against its manifest; raise :class:`CheckpointIntegrityError` naming the
    first damaged or missing file. Returns how many files were checked (0: a checkpoint without manifest).

    ``checksums=False`` compares sizes only. ``share=(i, n)`` checks every ``n``-th file from the ``i``-th
    (ranks split the reading).

    Example:
        >>> # not run: needs files (a checkpoint)
        >>> verify_checkpoint("ckpts/last.ckpt")  # doctest: +SKIP
        7
    """
    p = Path(path)
    body = _read_manifest(p)
    if body is None:
        return 0
    files = body["files"]
    names = sorted(files)[share[0]::share[1]]
    for name in names:
        problem = _check_file(p, name, files[name], checksums)
        if problem:
            raise CheckpointIntegrityError(f"{problem}. Use another checkpoint.")
    return len(names)


def _verify_on_all_ranks(path: str, checksums: bool) -> None:
    """Each rank checks its share of the files; every rank raises the same error if any file is damaged."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        verify_checkpoint(path, checksums)
        return
    _read_manifest(Path(path))  # a damaged manifest fails identically on every rank, before any collective
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        verify_checkpoint(path, checksums, share=(rank, world))
        problem = None
    except CheckpointIntegrityError as err:
        problem = str(err)
    problems: list[Optional[str]] = [None] * world
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first:
        raise CheckpointIntegrityError(first)


# ------------------------------------------------------------------ save and load
class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (the previous checkpoint at its path is untouched); raised on every rank."""


def _group_rank_world(group: Optional[dist.ProcessGroup]) -> tuple[bool, int, int]:
    """(distributed, rank, world) of ``group`` (the default group when ``None``)."""
    if not dist.is_initialized():
        return False, 0, 1
    return True, dist.get_rank(group), dist.get_world_size(group)


def _begin_save(final: Path, is_global_zero: bool, group: Optional[dist.ProcessGroup] = None) -> Path:
    """Put a complete sibling back, remove leftovers and create ``<final>.partial`` (rank 0), then a barrier over
    ``group``; return the ``.partial`` directory every rank writes into."""
    tmp, old = _siblings(final)
    if is_global_zero:
        recover_checkpoint(final)  # a complete checkpoint left by an interrupted swap goes back to `path` first
        for leftover in (tmp, old):  # then nothing beside `path` is needed any more
            if os.path.lexists(leftover):
                _remove(leftover)
        _file_op("mkdir", lambda p: p.mkdir(parents=True), tmp)
    if dist.is_initialized():
        dist.barrier(group=group)
    return tmp


def _dcp_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What DCP writes, popped from Lightning's dict (``checkpoint`` keeps the rest, the ``meta.pt`` part)."""
    state = {"model": checkpoint.pop("state_dict")}
    for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = opt_state
    return state


def _meta_bytes(checkpoint: dict[str, Any]) -> bytes:
    """``meta.pt``'s bytes: Lightning's dict without the DCP part (serialised at once, so later changes to the
    live loop state are not in it)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def _finish_save(tmp: Path, final: Path, meta: Optional[bytes], is_global_zero: bool, checksums: bool,
                group: Optional[dist.ProcessGroup] = None, failure: Optional[str] = None) -> None:
    """Every rank, after its DCP shards are in ``tmp``: hash a share of the files; rank 0 then writes ``meta.pt``
    (``meta``, rank 0's), the manifest and the ``.complete`` marker and swaps ``tmp`` into ``final``. Collectives
    over ``group`` only (a gloo group for a background save). ``failure``: this rank's write failed (the message);
    a failure on any rank leaves ``final`` untouched and raises :class:`CheckpointSaveError` on every rank (rank
    0's own exception, re-raised, where its commit failed)."""
    distributed, rank, world = _group_rank_world(group)
    if distributed:
        dist.barrier(group=group)  # every rank's files are written
    entries: dict[str, dict[str, Any]] = {}
    problem = failure
    if problem is None:  # every rank hashes a share of the files just written (read back from the page cache)
        try:
            names = sorted(n for n in os.listdir(tmp) if n not in (META_FILE, MANIFEST_FILE, _COMPLETE))
            entries = _file_entries(tmp, names[rank::world], checksums)
        except OSError as err:
            problem = f"rank {rank} could not read the files back ({type(err).__name__}: {err})"
    parts: list[Any] = [(entries, problem)]
    if distributed:
        parts = [None] * world
        dist.all_gather_object(parts, (entries, problem), group=group)
    problems = [p for _, p in parts if p]
    error: Optional[BaseException] = None
    if is_global_zero and not problems:
        assert meta is not None
        files: dict[str, dict[str, Any]] = {}
        for part, _ in parts:
            files.update(part)
        try:
            _commit(tmp, final, files, meta, checksums)
        except BaseException as err:  # told to the other ranks, then re-raised here
            error = err
    outcome = problems[0] if problems else (f"{type(error).__name__} on rank 0: {error}" if error else None)
    if distributed:
        box = [outcome]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        outcome = box[0]
    if error is not None:
        raise error
    if outcome:
        raise CheckpointSaveError(f"Could not save {final}: {outcome}. It was not completed ({tmp.name} is left "
                                  f"incomplete); a previous checkpoint at {final.name} is untouched.")


def _commit(tmp: Path, final: Path, files: dict[str, dict[str, Any]], meta: bytes, checksums: bool) -> None:
    """Rank 0: ``meta.pt``, the manifest, the marker, then the two renames into ``final`` (module docstring)."""
    _, old = _siblings(final)
    files[META_FILE] = {"bytes": len(meta), "sha256": hashlib.sha256(meta).hexdigest() if checksums else None}
    _file_op("write", _write_file, tmp / META_FILE, meta)
    _file_op("write", _write_file, tmp / MANIFEST_FILE, _manifest_bytes(files, checksums))
    _file_op("write", _write_file, tmp / _COMPLETE, b"")  # complete from here on
    _fsync_dir(tmp)
    if os.path.lexists(final):
        _replace(final, old)  # crash after this: `.partial` (new) and `.old` are complete; recovery picks `.partial`
    _replace(tmp, final)
    if os.path.lexists(old):
        _remove(old)


def save_sharded(checkpoint: dict[str, Any], path: str, is_global_zero: bool, checksums: bool = True) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a sharded DCP directory at ``path``, crash-safely.

    Works with or without a process group (one process). ``checksums=False`` records only file sizes in
    the manifest (for checkpoints so large that hashing them costs too much save time). In the background:
    :class:`~lightning_4d.checkpoint.background.BackgroundSaver`.
    """
    import torch.distributed.checkpoint as dcp

    final = Path(path)
    tmp = _begin_save(final, is_global_zero)
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = _dcp_state(checkpoint)
    meta = _meta_bytes(checkpoint) if is_global_zero else None
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")  # every rank's own random streams
    _finish_save(tmp, final, meta, is_global_zero, checksums)


def _names(keys: Iterable[str], limit: int = 6) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", … ({len(keys)} in all)" if len(keys) > limit else "")


def _checkpoint_model_shapes(path: str) -> dict[str, Optional[tuple[int, ...]]]:
    """The checkpoint's model keys and the global shape of each saved tensor (``None`` for non-tensors)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise ValueError(f"{Path(path) / '.metadata'} is damaged: {type(err).__name__}: {_first_line(err)}.") from err
    out: dict[str, Optional[tuple[int, ...]]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model."):
            size = getattr(meta, "size", None)
            out[key[len("model."):]] = tuple(size) if size is not None else None
    return out


def _shape_mismatches(saved: dict[str, Optional[tuple[int, ...]]], live: dict[str, Any]) -> list[str]:
    """``"name: saved (a, b), model (c, d)"`` for every key whose global shapes differ, over all ranks (pipeline
    stages hold different keys), sorted; every rank gets the same list."""
    mine = []
    for key, value in live.items():
        want = saved.get(key)
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        if want is not None and shape is not None and want != shape:
            mine.append(f"{key}: saved {want}, model {shape}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Optional[list[str]]] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        mine = [item for part in parts for item in part]
    return sorted(set(mine))


def _union_over_ranks(keys: set[str]) -> set[str]:
    """Pipeline stages hold different parameters: the model's keys are those of every rank together."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return keys
    parts: list[Optional[list[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sorted(keys))
    return set().union(*parts)


def load_sharded(path: str, model: nn.Module, optimizers: Iterable[Union[Optimizer, LightningOptimizer]],
                 verify: bool = True, strict: bool = True,
                 relax: str = "Set `strict_loading = False` on the LightningModule") -> dict[str, Any]:
    """Load model and optimizer shards from ``path`` into the live objects; return the rest.

    Before reading: an interrupted swap is recovered (rank 0), the files are checked against the
    manifest (``verify=False``: sizes only), and the checkpoint's parameter names are compared with the
    model's. ``strict=True`` refuses a checkpoint with keys the model lacks or without keys it has,
    naming them (and ``relax``: how the caller's API turns strictness off); ``strict=False`` loads the keys both
    have, warns with the skipped ones and, when names differ, leaves the optimizers as they are.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    if rank == 0:
        try:
            recover_checkpoint(path)
        except OSError:
            pass  # check_checkpoint names the complete sibling
    if distributed:
        dist.barrier()
    check_checkpoint(path)
    _verify_on_all_ranks(path, checksums=verify)
    optimizers = [_unwrap_optimizer(o) for o in optimizers]
    state: dict[str, dict[str, Any]] = {"model": model_state_dict(model)}
    shapes = _checkpoint_model_shapes(path)
    saved = set(shapes)
    live = _union_over_ranks(set(state["model"]))
    unexpected, missing = saved - live, live - saved
    if unexpected or missing:
        what = "; ".join(part for part in (
            f"{len(unexpected)} unexpected keys the model lacks ({_names(unexpected)})" if unexpected else "",
            f"{len(missing)} missing keys the model has ({_names(missing)})" if missing else "") if part)
        if strict:
            raise ValueError(
                f"Could not load {path}: it does not match {type(model).__name__}: {what}. Is it a checkpoint of "
                f"another model (other depth, sizes or names)? {relax} to load only the keys both have."
            )
        warnings.warn(f"Partial load of {path}: {what}; those keys are skipped and the "
                      f"optimizer state is not loaded.", stacklevel=2)
        state["model"] = {k: v for k, v in state["model"].items() if k in saved}
        optimizers = []
    wrong = _shape_mismatches(shapes, state["model"])
    if wrong:
        listed = "; ".join(wrong[:5]) + (f"; and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        raise ValueError(
            f"Could not load {path}: it does not match {type(model).__name__}: {len(wrong)} parameter(s) have other "
            f"shapes ({listed}). Is it a checkpoint of the same architecture with other sizes (hidden size, "
            f"vocabulary, heads)? Build the model with the sizes it was saved with.")
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state_dict(model, opt)
    try:
        dcp.load(state, checkpoint_id=path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        raise ValueError(
            f"Could not load {path}: {_first_line(err)}. The checkpoint is damaged or belongs to another model "
            f"(parameter names or shapes differ); the live model and optimizer may be partially loaded."
        ) from err
    from lightning_4d.tensor_parallel.layouts import sharded_state

    perms = _perms(model)
    options = _options()
    if not strict:
        from dataclasses import replace

        options = replace(options, strict=False)
    set_model_state_dict(model, sharded_state(state["model"], perms), options=options)
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, sharded_state(state[f"optimizer_{i}"], perms),
                                 options=_options(optimizer=True))
    rng = Path(path) / f"rng_rank{rank}.pt"
    if rng.exists():
        _set_rng_state(_load_file(rng))
    return _load_file(Path(path) / META_FILE)


def _load_file(file: Path) -> Any:
    """``torch.load`` with an error naming the file when it is damaged."""
    try:
        return torch.load(file, weights_only=False)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:
        raise CheckpointIntegrityError(
            f"{file} is damaged: it cannot be read ({type(err).__name__}: {_first_line(err)}). Use another checkpoint."
        ) from err


def _first_line(err: BaseException) -> str:
    """The cause of ``err`` in one line (for DCP's exceptions: the first failing rank's own exception)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, pair = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, BaseException):
            return f"{type(inner).__name__}: {_first_line(inner)} (rank {rank})"
    text = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return text[0][:500] if text else type(err).__name__

def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's own GPU (the current device) only: a resume where a process sees fewer GPUs still loads it.
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    own = state.get("cuda_device")
    if own is None and state.get("cuda") and torch.cuda.is_available():
        # An older checkpoint: every visible GPU's state; this rank used its local rank's device.
        every = state["cuda"]
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        own = every[index] if 0 <= index < len(every) else None
    if own is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own)
