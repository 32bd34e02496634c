"""Export a sharded checkpoint of a Hugging Face model to a directory ``from_pretrained`` loads.

The checkpoint (any layout; files verified against the manifest) is never merged in memory: the model is
built from its config on the meta device, the LightningModule's and wrapper's prefixes are stripped from the
checkpoint's names (from DCP's metadata) so they equal ``AutoModelForCausalLM.from_pretrained(base)
.state_dict()``'s, names, shapes and dtypes are checked against the meta model, and then one tensor at a
time is read, converted as ``save_pretrained`` converts it (tied copies dropped, transformers' on-disk
names and layouts: ``revert_weight_conversion`` applied per tensor, or per group of tensors that convert
together) and written to Hugging Face's sharded layout. ``config.json`` and ``generation_config.json`` are
written by ``save_pretrained`` itself (of the meta model, without weights). Tokenizer, chat-template and
generation-config files are copied from the base directory when there is one.

Where the config comes from: ``base`` (a model directory) when given; otherwise the record a
:class:`~lightning_4d.models.CausalLM` around an :class:`~lightning_4d.models.HFLogits` writes into every
checkpoint (the config JSON and the directory it was loaded from).

Example:
    >>> # not run: needs files (a checkpoint, a model directory)
    >>> export_hf("outputs/run/checkpoints/step=100.ckpt", "my-finetuned-llama")  # doctest: +SKIP
    PosixPath('my-finetuned-llama')
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, TypeVar, Union

import torch
from torch import nn

from lightning_4d._compat.hf_saving import revert_conversion, saved_state
from lightning_4d.checkpoint.stream import (DEFAULT_MAX_SHARD_SIZE, SAFE_WEIGHTS_INDEX, SafetensorsWriter, TensorSpec,
                                            atomic_directory, check_new_directory, parse_size, plan_shards,
                                            write_index)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from lightning_4d.checkpoint.stream import CheckpointReader

__all__ = ["SIDE_FILES", "conversion_groups", "export_hf", "load_strict", "per_row_outputs", "resolve_names",
           "strip_prefix"]

PathLike = Union[str, "os.PathLike[str]"]
_V = TypeVar("_V")

SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
"""Files copied from the base directory beside the exported weights (those present)."""


def _names(keys: Iterable[str], limit: int = 6) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", … ({len(keys)} in all)" if len(keys) > limit else "")


def strip_prefix(state: dict[str, _V], own_keys: Iterable[str]) -> tuple[str, dict[str, _V]]:
    """Find the prefix that maps ``state``'s names onto ``own_keys`` (the most keys matched) and strip it;
    keys without the prefix are kept unchanged (and then reported as unexpected by :func:`load_strict`).

    Example:
        >>> strip_prefix({"model.model.lm_head.weight": 1, "model.model.model.norm.weight": 2},
        ...              ["lm_head.weight", "model.norm.weight"])
        ('model.model.', {'lm_head.weight': 1, 'model.norm.weight': 2})
    """
    own = set(own_keys)
    votes: Counter[str] = Counter()
    for key in state:
        parts = key.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in own:
                votes[".".join(parts[:i]) + "." if i else ""] += 1
    if not votes:
        return "", dict(state)
    prefix = max(votes, key=lambda p: (votes[p], -len(p)))
    return prefix, {k.removeprefix(prefix): v for k, v in state.items()}


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """State-dict names sharing one tensor (tied weights), each mapped to all names of its tensor."""
    groups: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(tensor), []).append(name)
    return {name: names for names in groups.values() for name in names}


def resolve_names(own: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]],
                  aliases: Mapping[str, list[str]], model_name: str, source: str = "the checkpoint") -> dict[str, str]:
    """Map every name of a model (``own``: name → shape) to the name in ``given`` that holds its value: the
    same name, or for a missing one a weight tied to it (``aliases``: name → all names of its tensor).

    Raises:
        ValueError: naming the missing keys, the unexpected keys and the shape mismatches.

    Example:
        >>> resolve_names({"emb": (4, 2), "head": (4, 2)}, {"emb": (4, 2)}, {"emb": ["emb", "head"],
        ...               "head": ["emb", "head"]}, "Tied")
        {'emb': 'emb', 'head': 'emb'}
    """
    full = {key: key for key in given}
    for key in set(own) - set(given):
        present = [a for a in aliases.get(key, []) if a in given]
        if present:
            full[key] = present[0]
    missing = sorted(set(own) - set(full))
    unexpected = sorted(set(full) - set(own))
    shapes = [f"{k} {tuple(given[full[k]])} vs {tuple(own[k])}" for k in sorted(set(own) & set(full))
              if tuple(given[full[k]]) != tuple(own[k])]
    problems = [part for part in (
        f"{len(missing)} missing keys ({_names(missing)})" if missing else "",
        f"{len(unexpected)} unexpected keys ({_names(unexpected)})" if unexpected else "",
        f"{len(shapes)} shape mismatches (checkpoint vs model: {'; '.join(shapes[:4])})" if shapes else "") if part]
    if problems:
        raise ValueError(f"{source} does not match {model_name}: {'; '.join(problems)}. Is it a checkpoint "
                         f"of another model (other depth, sizes or names)?")
    return {key: full[key] for key in own}


@torch.no_grad()
def load_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str = "the checkpoint") -> None:
    """Load ``state`` into ``model`` requiring the same names and shapes; a name missing from ``state`` is
    accepted only when a weight tied to it (same tensor in ``model``) is present.

    Raises:
        ValueError: naming the missing keys, the unexpected keys and the shape mismatches.

    Example:
        >>> load_strict(nn.Linear(2, 2), {"weight": torch.zeros(2, 2)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the checkpoint does not match Linear: 1 missing keys (bias). Is it a checkpoint of ...
    """
    own = model.state_dict()
    names = resolve_names({k: tuple(v.shape) for k, v in own.items()}, {k: tuple(v.shape) for k, v in state.items()},
                          _aliases(model), type(model).__name__, source)
    model.load_state_dict({key: state[name] for key, name in names.items()}, strict=True)


def _meta_record(checkpoint: Path) -> Optional[dict[str, Any]]:
    from lightning_4d.checkpoint.state import META_FILE, _load_file
    from lightning_4d.analysis.hf_config import CHECKPOINT_KEY

    meta = _load_file(checkpoint / META_FILE)
    record = meta.get(CHECKPOINT_KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, dict) and "config" in record else None


def _resolve(checkpoint: Path, base: Optional[PathLike]) -> tuple[PretrainedConfig, Optional[Path]]:
    """The model config and the directory side files come from."""
    from lightning_4d.analysis.hf_config import config_from_record, load_hf_config

    if base is not None:
        base_dir = Path(base)
        try:
            config = load_hf_config(base_dir)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"base={base}: {err}") from None
        except ValueError as err:
            raise ValueError(f"base={base}: {err}") from None
        if not base_dir.is_dir():
            raise ValueError(f"base={base} is a file: pass the model directory (config.json, tokenizer files).")
        return config, base_dir
    record = _meta_record(checkpoint)
    if record is None:
        raise ValueError(
            f"{checkpoint} records no Hugging Face config (it was not written by a CausalLM around HFLogits): pass "
            f"the model directory it was trained from, e.g. --base DIR (base=DIR in Python).")
    recorded = Path(record["base"]) if record.get("base") else None
    if recorded is not None and not recorded.is_dir():
        warnings.warn(f"{checkpoint} was trained from {recorded}, which no longer exists: the config comes from the "
                      f"checkpoint, no tokenizer files are copied (pass --base DIR to copy them).", stacklevel=3)
        recorded = None
    return config_from_record(record), recorded


def _meta_model(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` on the meta device: names, shapes, dtypes and tied weights, no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _dtype_of(specs: Mapping[str, TensorSpec]) -> torch.dtype:
    floats = [s.dtype for s in specs.values() if s.dtype.is_floating_point]
    return Counter(floats).most_common(1)[0][0] if floats else torch.float32


def conversion_groups(revert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                      tensors: Mapping[str, torch.Tensor]) -> Optional[list[tuple[list[str], dict[str, TensorSpec]]]]:
    """Split ``tensors`` (meta) into the smallest groups that ``revert`` converts on their own, each with the
    names and specs it writes; ``None`` when no split reproduces ``revert(tensors)`` exactly.

    One-to-one and one-to-many conversions (renames, fused experts split per expert) give one group per
    tensor; many-to-one ones (e.g. ``q``, ``k``, ``v`` written as one fused tensor) group the tensors whose
    outputs share a name. Every group's output is checked against the whole conversion's (names, shapes,
    dtypes), computed on the meta device.

    Example:
        >>> t = {"a": torch.empty(2, device="meta"), "b": torch.empty(3, device="meta")}
        >>> [(keys, list(out)) for keys, out in conversion_groups(lambda sd: dict(sd), t)]
        [(['a'], ['a']), (['b'], ['b'])]
    """
    def probe(keys: Iterable[str]) -> Optional[dict[str, TensorSpec]]:
        try:
            return {k: TensorSpec.of(v) for k, v in revert({key: tensors[key] for key in keys}).items()}
        except Exception:  # a conversion that needs the other tensors of its group
            return None

    full = probe(tensors)
    if full is None:
        return None
    parent = {key: key for key in tensors}

    def find(key: str) -> str:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    def union(a: str, b: str) -> None:
        parent[find(b)] = find(a)

    alone: dict[str, dict[str, TensorSpec]] = {}
    producers: dict[str, list[str]] = {}
    odd: dict[str, str] = {}  # key → its module's parent: keys that convert wrongly alone, grouped by module
    for key in tensors:
        got = probe([key])
        if got is None or any(full.get(name) != spec for name, spec in got.items()):
            odd[key] = key.rsplit(".", 2)[0]
        if got is not None:
            alone[key] = got
            for name in got:
                producers.setdefault(name, []).append(key)
    for keys in producers.values():  # tensors that write to one name convert together
        for key in keys[1:]:
            union(keys[0], key)
    first: dict[str, str] = {}
    for key, module in odd.items():  # and so do the odd ones of one module (e.g. q, k, v of one attention)
        union(first.setdefault(module, key), key)
    members: dict[str, list[str]] = {}
    for key in tensors:
        members.setdefault(find(key), []).append(key)
    groups: list[tuple[list[str], dict[str, TensorSpec]]] = []
    for keys in members.values():
        got = alone.get(keys[0]) if len(keys) == 1 and keys[0] not in odd else probe(keys)
        if got is None or any(full.get(name) != spec for name, spec in got.items()):
            return None
        groups.append((keys, got))
    written = [name for _, got in groups for name in got]
    return groups if len(written) == len(set(written)) and set(written) == set(full) else None


def _copy_side_files(base_dir: Optional[Path], target: Path) -> list[str]:
    copied: list[str] = []
    if base_dir is None:
        return copied
    for name in SIDE_FILES:
        src = base_dir / name
        if src.is_file():
            shutil.copy2(src, target / name)
            copied.append(name)
    return copied


def _write_group(writer: SafetensorsWriter, sources: Mapping[str, tuple[str, torch.dtype]], reader: CheckpointReader,
                 revert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Read the tensors of one conversion group (model name → checkpoint name, dtype), cast, convert, write."""
    tensors: dict[str, torch.Tensor] = {}
    for key, (name, dtype) in sources.items():
        value = reader.read(name)
        tensors[key] = value if value.dtype == dtype else value.to(dtype)
    for name, value in revert(tensors).items():
        writer.write(name, value)


def per_row_outputs(revert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], key: str,
                    tensor: torch.Tensor, outputs: Mapping[str, TensorSpec]) -> Optional[Callable[[int], dict[str, str]]]:
    """For a model tensor ``key`` (meta ``tensor``, ``E`` rows) whose conversion writes ``outputs``: when the
    conversion of its rows ``[i, i+1)`` alone gives the outputs of row ``i`` (e.g. a fused expert stack written as
    ``experts.{i}.…`` per expert), a function mapping ``i`` to ``{name the one-row conversion writes: the output
    name}``; ``None`` otherwise (checked on meta for every row, so nothing is assumed).

    Example:
        >>> t = torch.empty(2, 3, device="meta")
        >>> split = lambda sd: {f"e.{i}.w": v[i] for k, v in sd.items() for i in range(v.shape[0])}
        >>> per_row_outputs(split, "w", t, {"e.0.w": TensorSpec((3,), torch.float32),
        ...                                 "e.1.w": TensorSpec((3,), torch.float32)})(1)
        {'e.0.w': 'e.1.w'}
    """
    rows = tensor.shape[0] if tensor.dim() >= 2 else 0
    if rows < 2:
        return None
    try:
        one = {n: TensorSpec.of(v) for n, v in revert({key: tensor[:1]}).items()}
    except Exception:  # a conversion that needs the whole tensor
        return None
    if len(one) * rows != len(outputs):
        return None
    fields: dict[str, int] = {}
    for name in one:
        parts = name.split(".")
        found = [p for p, part in enumerate(parts) if part == "0"
                 and all(".".join(parts[:p] + [str(i)] + parts[p + 1:]) in outputs for i in range(rows))]
        if len(found) != 1:
            return None
        fields[name] = found[0]

    def names(i: int) -> dict[str, str]:
        out = {}
        for name, p in fields.items():
            parts = name.split(".")
            out[name] = ".".join(parts[:p] + [str(i)] + parts[p + 1:])
        return out

    if any(one[n] != outputs[names(i)[n]] for i in range(rows) for n in one):
        return None
    return names


def _write_rows(writer: SafetensorsWriter, key: str, source: tuple[str, torch.dtype], rows: int, reader: CheckpointReader,
                revert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                names: Callable[[int], dict[str, str]]) -> None:
    """Write a per-row conversion (one expert at a time): read row ``i`` alone, convert, write under its names."""
    name, dtype = source
    for i in range(rows):
        value = reader.read_rows(name, i, i + 1)
        value = value if value.dtype == dtype else value.to(dtype)
        rename = names(i)
        for out, tensor in revert({key: value}).items():
            writer.write(rename[out], tensor)
        del value, tensor  # before the next expert is read: one expert in memory at a time


def export_hf(checkpoint: PathLike, out: PathLike, base: Optional[PathLike] = None, verify: bool = True,
              dtype: Optional[Union[str, torch.dtype]] = None,
              max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write a sharded checkpoint of a Hugging Face causal LM as a ``save_pretrained`` directory, one tensor
    at a time.

    The model is built from its config on the meta device (no storage); the checkpoint's names, shapes and
    dtypes are checked against it from DCP's metadata before any weight is read. Then each tensor is read,
    cast, converted to transformers' on-disk names and layout (tied copies dropped, fused experts split per
    expert, as ``save_pretrained`` does) and written to its place in ``model.safetensors`` or, above
    ``max_shard_size``, ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``. A stacked
    expert tensor that transformers writes per expert is read and written one expert at a time
    (:func:`per_row_outputs`, ``CheckpointReader.read_rows``: only the saved chunks holding that expert). Peak
    memory: about twice the checkpoint's largest tensor other than such stacks, or of its largest saved chunk
    (DCP deserialises a saved chunk, then copies it into place), whatever the model or shard size.

    Args:
        checkpoint: a checkpoint directory written by ``FourDStrategy`` (any layout).
        out: the directory to create (refused when it exists and is not empty); written under
            ``<out>.partial`` and renamed when complete.
        base: the model directory trained from (config, tokenizer files). Optional for checkpoints of a
            :class:`~lightning_4d.models.CausalLM` around :class:`~lightning_4d.models.HFLogits`, which
            record the config and that directory.
        verify: check every checkpoint file's SHA-256 against the manifest (``False``: sizes only).
        dtype: ``float32``, ``bfloat16`` or ``float16`` to cast the weights to (``None``: as trained).
        max_shard_size: largest safetensors file (bytes, or ``"5GB"``, ``"500MB"``); a larger tensor gets a
            file of its own. Default ``"50GB"``, as ``save_pretrained``.

    Returns:
        ``out``; ``AutoModelForCausalLM.from_pretrained(out)`` loads it.

    Raises:
        ValueError: the checkpoint's names, shapes or dtypes do not match the config's model (naming the
            keys), no config is recorded and no ``base`` given, or ``out`` is not empty.

    Example:
        >>> # not run: needs files (a checkpoint, a model directory)
        >>> export_hf("ckpts/last.ckpt", "exported", base="pretrained/llama", max_shard_size="5GB")  # doctest: +SKIP
        PosixPath('exported')
    """
    from lightning_4d.checkpoint.consolidate import open_checkpoint
    from lightning_4d.checkpoint.state import check_checkpoint
    from lightning_4d.analysis.hf_config import resolve_dtype

    target = Path(out)
    check_new_directory(target)
    parse_size(max_shard_size)  # a bad size fails before any reading
    cast = resolve_dtype(dtype)
    if cast == "auto":
        cast = None
    ckpt = check_checkpoint(checkpoint)
    config, base_dir = _resolve(ckpt, base)
    reader = open_checkpoint(ckpt, verify=verify)
    model = _meta_model(config, cast if isinstance(cast, torch.dtype) else _dtype_of(reader.specs))
    own = model.state_dict()
    prefix, specs = strip_prefix(reader.specs, own)
    names = resolve_names({k: tuple(v.shape) for k, v in own.items()}, {k: s.shape for k, s in specs.items()},
                          _aliases(model), type(model).__name__, str(checkpoint))
    dtypes = [f"{k} {specs[n].dtype} vs {own[k].dtype}" for k, n in sorted(names.items())
              if specs[n].dtype != own[k].dtype and not (specs[n].dtype.is_floating_point and
                                                         own[k].dtype.is_floating_point)]
    if dtypes:
        raise ValueError(f"{checkpoint} does not match {type(model).__name__}: {len(dtypes)} dtype mismatches "
                         f"(checkpoint vs model: {'; '.join(dtypes[:4])}); only floating-point weights are cast.")
    saved = saved_state(model)
    groups = conversion_groups(lambda sd: revert_conversion(model, sd), saved)
    order = {k: TensorSpec.of(v) for k, v in revert_conversion(model, saved).items()}  # save_pretrained's order
    if groups is None:
        warnings.warn(f"transformers' on-disk conversion of {type(model).__name__} cannot be applied one tensor at "
                      f"a time: this export holds the whole model in memory.", stacklevel=2)
        groups = [(list(saved), order)]
    layout = plan_shards(order, max_shard_size)
    with atomic_directory(target) as tmp:
        model.save_pretrained(str(tmp), state_dict={})  # config.json, generation_config.json: as transformers writes
        for stray in [*tmp.glob("*.safetensors"), tmp / SAFE_WEIGHTS_INDEX]:
            stray.unlink(missing_ok=True)
        revert = lambda sd: revert_conversion(model, sd)  # noqa: E731
        with SafetensorsWriter(tmp, layout) as writer:
            for keys, outputs in groups:  # one group in memory at a time: about one tensor, or one expert
                rows = per_row_outputs(revert, keys[0], saved[keys[0]], outputs) if len(keys) == 1 else None
                if rows is not None:  # a stacked expert tensor written per expert: never the whole stack
                    _write_rows(writer, keys[0], (prefix + names[keys[0]], own[keys[0]].dtype),
                                saved[keys[0]].shape[0], reader, revert, rows)
                    continue
                _write_group(writer, {key: (prefix + names[key], own[key].dtype) for key in keys}, reader, revert)
        if len(layout) > 1:
            write_index(tmp, layout, total_parameters=model.num_parameters())
        _copy_side_files(base_dir, tmp)
    return target
