"""Pretrained weights of a local Hugging Face directory, streamed into a meta-built model one tensor at a time.

:class:`HFWeightSource` is the :class:`~lightning_4d.materialize.local_shards.WeightSource` that
:meth:`lightning_4d.models.HFLogits.from_pretrained` attaches (as ``fourd_weight_source``) to a ``…ForCausalLM``
built on the meta device. When ``FourDStrategy`` materialises only this rank's shards
(:func:`~lightning_4d.materialize.local_shards.materialize_local_shards`, :mod:`lightning_4d.materialize.load_sources`) it asks the source
for the rows holding this rank's elements (:meth:`~HFWeightSource.get_rows`: experts of a stacked expert tensor,
read from the files' per-expert keys, or rows of a tensor stored whole), a bounded piece at a time: a rank reads
only the tensors and experts it holds a part of, and never holds a tensor it does not keep beyond one piece.

What it does, with no tensor data read until :meth:`~HFWeightSource.get`:

- files: ``model.safetensors`` or the sharded layout (``model.safetensors.index.json`` + its files); each tensor is
  read with ``safetensors.safe_open`` on its own: the file is opened for that tensor, whose bytes are mapped and
  paged in only where this rank's slice touches them, and released with the tensor (nothing of a file stays
  mapped between reads, never a whole file in memory);
- names: checkpoint keys become the model's parameter names exactly as ``from_pretrained`` renames them
  (transformers 5's conversion mapping: renamings, the base-model prefix, and converters such as the per-expert
  ``experts.{i}.gate_proj.weight`` / ``up_proj`` tensors fused into the 3-D ``experts.gate_up_proj``, run by
  transformers' own ops); a 3-D model tensor ``….experts.NAME`` with no transformers rule is stacked from
  ``….experts.{i}.NAME[.weight]`` keys;
- checks, at construction, on every rank alike: every mapped tensor's shape (converters run on meta tensors);
  checkpoint keys that map to nothing while model parameters have no key fail, naming both; only missing
  parameters (they keep their initialisation, as with ``from_pretrained``) or only unused keys warn;
- tied weights: a tensor the model ties (``lm_head`` to ``embed_tokens``) is loaded once, from whichever name the
  files hold; buffers the files do not hold (rotary ``inv_freq``) keep the model's own values;
- dtype: each tensor is cast to the model tensor's dtype as it is read.

Example:
    >>> import torch, transformers
    >>> # not run: needs files (a model directory)
    >>> with torch.device("meta"):
    ...     net = transformers.AutoModelForCausalLM.from_config(cfg)  # doctest: +SKIP
    >>> net.fourd_weight_source = HFWeightSource("my-llama", net)  # doctest: +SKIP
    >>> materialize_pretrained(net)  # one process: the weights, as from_pretrained loads them  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_4d._compat.hf_loading import convert_group, model_transforms, natural_key, rename_key

if TYPE_CHECKING:
    from lightning_4d._compat.hf_loading import WeightRenaming

__all__ = ["HFWeightSource", "WeightMappingError", "materialize_pretrained", "safetensors_dtype", "safetensors_files"]

PathLike = Union[str, "os.PathLike[str]"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_STACK = -1  # a group stacked by the fallback rule, not by a transformers converter

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class WeightMappingError(ValueError):
    """The files of a model directory do not fit the model: unmappable keys, wrong shapes, a converter failing.

    Example:
        >>> issubclass(WeightMappingError, ValueError)
        True
    """


def _shown(names: Iterable[str], n: int = 6) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f" … ({len(names)} in all)" if len(names) > n else "")


def safetensors_files(directory: PathLike) -> dict[str, Path]:
    """Checkpoint key → the ``*.safetensors`` file holding it: from ``model.safetensors.index.json`` (the
    sharded layout) when present, else ``model.safetensors``, else every ``*.safetensors`` file; headers only.

    Raises:
        FileNotFoundError: no safetensors file, or a file the index names is absent.
        WeightMappingError: a key held by two files.

    Example:
        >>> safetensors_files("no/such/dir")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: no/such/dir holds no *.safetensors weights: ...
    """
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        absent = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if absent:
            raise FileNotFoundError(f"{index} names {_shown(absent)}, which {directory} does not hold: copy the "
                                    f"whole directory (every file of the index).")
        return {key: directory / name for key, name in weight_map.items()}
    files = [directory / SINGLE_FILE] if (directory / SINGLE_FILE).is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory} holds no *.safetensors weights: loading into shards reads safetensors files. Convert "
            f"pytorch_model*.bin once with AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir), or load "
            f"eagerly (HFLogits.from_pretrained(..., meta=False); recipes: meta_init=false).")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                if key in out:
                    raise WeightMappingError(f"{key} is in both {out[key].name} and {file.name} of {directory} and "
                                             f"there is no {INDEX_FILE} to say which to use; remove one copy.")
                out[key] = file
    return out


def safetensors_dtype(directory: PathLike) -> Optional[torch.dtype]:
    """The dtype of the first floating-point tensor of ``directory``'s safetensors files (what
    ``from_pretrained(dtype="auto")`` falls back to when ``config.json`` names none); ``None``: no such tensor.

    Example:
        >>> # not run: needs files (a model directory)
        >>> safetensors_dtype("my-llama")  # doctest: +SKIP
        torch.bfloat16
    """
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = defaultdict(list)
    for key, file in safetensors_files(directory).items():
        by_file[file].append(key)
    for file in sorted(by_file):
        with safe_open(str(file), framework="pt") as fh:
            for key in sorted(by_file[file], key=natural_key):
                dtype = _DTYPES.get(fh.get_slice(key).get_dtype())
                if dtype is not None and dtype.is_floating_point:
                    return dtype
    return None


@dataclass(frozen=True)
class _Group:
    """The checkpoint keys of one model tensor (several for a converter) and how they become it."""

    target: str  # the model name transformers renames the keys to (a converter's first target)
    sources: tuple[tuple[Optional[str], str], ...]  # (converter source pattern or None, checkpoint key), natural order
    converter: Optional[int]  # index into HFWeightSource._converters; None: a plain copy; _STACK: stacked on dim 0
    outputs: tuple[str, ...]  # model names produced (one, or several for a one-to-many converter)


class _ShapeModel:
    """What transformers' conversion ops read from the model (``get_parameter``), answered from saved shapes."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.shapes = shapes

    def get_parameter(self, name: str) -> Tensor:
        shape, dtype = self.shapes[name]
        return torch.empty(shape, dtype=dtype, device="meta")


class HFWeightSource:
    """The weights of a local Hugging Face directory as a :class:`~lightning_4d.materialize.local_shards.WeightSource` of
    ``model`` (a ``PreTrainedModel``, typically built on the meta device): :meth:`names` are ``model``'s tensor
    names, :meth:`get` reads one of them from the files (see the module docstring for renaming, converters, tied
    weights and dtypes). Everything is checked when the source is built, from the files' headers alone.

    Args:
        directory: the model directory (``config.json`` + ``*.safetensors``, single-file or sharded).
        model: the model the weights are for; only names, shapes, dtypes, ties and transformers' conversion rules
            are taken from it (no reference is kept).

    Raises:
        FileNotFoundError: no safetensors files (see :func:`safetensors_files`).
        WeightMappingError: a tensor's shape differs from the model's, a converter fails, or checkpoint keys map to
            nothing while model parameters have no key (both named).

    Example:
        >>> # not run: needs files (a model directory)
        >>> src = HFWeightSource("my-qwen3-moe", meta_model)  # doctest: +SKIP
        >>> src.get("model.layers.0.mlp.experts.gate_up_proj").shape  # doctest: +SKIP
        torch.Size([4, 64, 64])
    """

    def __init__(self, directory: PathLike, model: nn.Module) -> None:
        self.directory = Path(directory).absolute()
        self.reads = 0
        """Checkpoint tensors (or row slices of one) read from the files so far (this process)."""
        self.keys_read: set[str] = set()
        """The checkpoint keys read so far (this process)."""
        self.whole_reads: set[str] = set()
        """Model tensors :meth:`get_rows` had to read whole (a conversion whose rows are not checkpoint tensors)."""
        self._rows: dict[str, Optional[list[list[tuple[Optional[str], str]]]]] = {}
        self._whole: Optional[tuple[str, Tensor]] = None
        self.missing: list[str] = []
        """Model tensors the files do not hold (they keep their initialisation; tied aliases excluded)."""
        self.unexpected: list[str] = []
        """Checkpoint keys that map to no model tensor (ignored)."""
        self._owner: dict[str, str] = {}
        self._files = safetensors_files(self.directory)
        self._headers = self._read_headers()
        self._config = getattr(model, "config", None)
        self._model_class = type(model).__name__
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(dict(model.named_buffers(remove_duplicate=False)))
        model_keys = model.state_dict()  # parameters + persistent buffers, tied names included
        self._shapes = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
        renamings, self._converters = model_transforms(model)
        base_prefix = getattr(model, "base_model_prefix", None) or None
        groups, unexpected = self._map_keys(renamings, base_prefix, model_keys)
        groups = self._checked(groups)
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        aliases: dict[int, list[str]] = defaultdict(list)
        for name, t in tensors.items():
            aliases[id(t)].append(name)
        missing = self._missing(groups, model_keys, aliases, tensors)
        groups.update(self._checked(self._stack_fallback(missing, unexpected, tensors)))
        missing = self._missing(groups, model_keys, aliases, tensors)
        unexpected = {k: v for k, v in unexpected.items() if not _ignored(k, model, "_keys_to_ignore_on_load_unexpected")}
        missing = [n for n in missing if not _ignored(n, model, "_keys_to_ignore_on_load_missing")]
        self._groups = groups
        self._owner = {out: target for target, group in groups.items() for out in group.outputs}
        missing_params = [n for n in missing if n in params]
        if unexpected and missing_params:
            raise WeightMappingError(
                f"{self.directory}: the checkpoint keys {_shown(sorted(unexpected, key=natural_key))} match no tensor "
                f"of {self._model_class}, and its parameters {_shown(missing_params)} have no checkpoint key. "
                f"transformers has no conversion rule from these keys to these names. Save the weights under the "
                f"model's own names (from_pretrained then save_pretrained with this transformers version), or "
                f"register a rule with transformers.conversion_mapping.register_checkpoint_conversion_mapping.")
        self.missing = missing
        self.unexpected = sorted(unexpected, key=natural_key)

    # ------------------------------------------------------------------ the WeightSource protocol
    def names(self) -> list[str]:
        """The model tensor names the files provide, in checkpoint order.

        Example:
            >>> # not run: needs files (a model directory)
            >>> "model.embed_tokens.weight" in src.names()  # doctest: +SKIP
            True
        """
        return list(self._owner)

    def get(self, name: str) -> Tensor:
        """Model tensor ``name``, read now from the files (its checkpoint keys one at a time, converted as
        transformers converts them), in the model tensor's dtype.

        Raises:
            KeyError: ``name`` is not one of :meth:`names`.

        Example:
            >>> # not run: needs files (a model directory)
            >>> src.get("lm_head.weight").dtype  # doctest: +SKIP
            torch.float32
        """
        if name not in self._owner:
            raise KeyError(f"{name} is not in the weights of {self.directory} (see .names(); missing: "
                           f"{_shown(self.missing)})")
        group = self._groups[self._owner[name]]
        out = self._run(group, self._reader(name_dtype=self._shapes[group.target][1]))
        return out[name]

    def get_rows(self, name: str, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` of dim 0 of model tensor ``name`` — experts ``start … stop-1`` of a stacked
        expert tensor — reading only those rows: for a tensor stored as it is, those rows' bytes; for one
        transformers builds from per-expert keys (``experts.{i}.gate_proj.weight`` …), only experts
        ``start … stop-1``'s keys, converted by transformers' own ops. A conversion whose rows are not per-index
        keys is read whole and sliced (named in :attr:`whole_reads`).

        Raises:
            KeyError: ``name`` is not one of :meth:`names`.

        Example:
            >>> # not run: needs files (a model directory)
            >>> src.get_rows("model.layers.0.mlp.experts.gate_up_proj", 2, 4).shape  # doctest: +SKIP
            torch.Size([2, 64, 64])
        """
        if name not in self._owner:
            raise KeyError(f"{name} is not in the weights of {self.directory} (see .names())")
        group = self._groups[self._owner[name]]
        shape, dtype = self._shapes[group.target]
        if group.converter is None:
            self._whole = None
            return self._read_rows(group.sources[0][1], start, stop, dtype)
        per_row = self._row_sources(group)
        if per_row is None:  # read whole once, kept until another tensor is asked for (the chunks of one tensor)
            self.whole_reads.add(name)
            if self._whole is None or self._whole[0] != name:
                self._whole = None
                self._whole = (name, self.get(name))
            return self._whole[1][start:stop].clone()
        self._whole = None
        if group.converter == _STACK:
            return torch.stack([self.read(key, dtype) for i in range(start, stop) for _, key in per_row[i]])
        return self._convert_rows(group, per_row[start:stop], self._reader(dtype))[name]

    def _read_rows(self, key: str, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[key]), framework="pt") as fh:
            tensor = fh.get_slice(key)[start:stop]
        self.reads += 1
        self.keys_read.add(key)
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    def _convert_rows(self, group: _Group, rows: list[list[tuple[Optional[str], str]]],
                      reader: Callable[[str], Callable[[], Tensor]]) -> dict[str, Tensor]:
        shape, dtype = self._shapes[group.target]
        shapes = {**self._shapes, group.target: ((len(rows), *shape[1:]), dtype)}
        sources = [(pattern or "", key, reader(key)) for row in rows for pattern, key in row]
        with torch.no_grad():
            return convert_group(self._converters[group.converter], group.target, sources, _ShapeModel(shapes),
                                 self._config)

    def _row_sources(self, group: _Group) -> Optional[list[list[tuple[Optional[str], str]]]]:
        """Per row of ``group``'s tensor, its checkpoint keys: the one numeric key field that varies across the
        group is the row (expert) index; a conversion of one or two rows must give that many rows (checked on
        meta). ``None``: rows do not map to keys."""
        if group.target in self._rows:
            return self._rows[group.target]
        shape, dtype = self._shapes[group.target]
        found: Optional[list[list[tuple[Optional[str], str]]]] = None
        parts = [key.split(".") for _, key in group.sources]
        if len(group.outputs) == 1 and len({len(p) for p in parts}) == 1:
            fields = [i for i in range(len(parts[0]))
                      if all(p[i].isdigit() for p in parts) and len({p[i] for p in parts}) > 1]
            if len(fields) == 1:
                by_row: dict[int, list[tuple[Optional[str], str]]] = defaultdict(list)
                for source, p in zip(group.sources, parts):
                    by_row[int(p[fields[0]])].append(source)
                if sorted(by_row) == list(range(shape[0])) and len({len(v) for v in by_row.values()}) == 1:
                    found = [by_row[i] for i in range(shape[0])]
        if found is not None and group.converter != _STACK:
            for k in {1, min(2, shape[0])}:
                try:
                    out = self._convert_rows(group, found[:k], self._meta_reader(dtype))[group.target]
                except Exception:  # a conversion that needs every row: read whole
                    found = None
                    break
                if tuple(out.shape) != (k, *shape[1:]):
                    found = None
                    break
        self._rows[group.target] = found
        return found

    def release(self) -> None:
        """Drop the whole tensor :meth:`get_rows` keeps between calls for a conversion it cannot read by rows
        (:func:`lightning_4d.materialize.load_sources.load_sources` calls it after each tensor).

        Example:
            >>> # not run: needs files (a model directory)
            >>> src.release()  # doctest: +SKIP
        """
        self._whole = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "HFWeightSource":
        return self  # read-only: a meta skeleton of the model shares it

    def __repr__(self) -> str:
        return (f"HFWeightSource({str(self.directory)!r}, {len(self._owner)} tensors from "
                f"{len(set(self._files.values()))} file(s), missing={len(self.missing)}, "
                f"unexpected={len(self.unexpected)})")

    def describe(self) -> str:
        """One line on what the files hold compared with the model (for logs).

        Example:
            >>> # not run: needs files (a model directory)
            >>> src.describe()  # doctest: +SKIP
            'my-llama: 26 tensors of LlamaForCausalLM from 1 file(s); all model parameters present'
        """
        parts = [(f"{self.directory.name}: {len(self._owner)} tensors of {self._model_class} from "
                  f"{len(set(self._files.values()))} file(s)")]
        parts.append(f"missing (kept as initialised): {_shown(self.missing)}" if self.missing
                     else "all model parameters present")
        if self.unexpected:
            parts.append(f"unused checkpoint keys: {_shown(self.unexpected)}")
        return "; ".join(parts)

    # ------------------------------------------------------------------ reading
    def _read_headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = defaultdict(list)
        for key, file in self._files.items():
            by_file[file].append(key)
        headers: dict[str, tuple[tuple[int, ...], str]] = {}
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt") as fh:
                present = set(fh.keys())
                for key in keys:
                    if key not in present:
                        raise WeightMappingError(f"{INDEX_FILE} of {self.directory} puts {key} in {file.name}, which "
                                                 f"does not hold it; the directory is incomplete or mixed.")
                    piece = fh.get_slice(key)
                    headers[key] = (tuple(piece.get_shape()), piece.get_dtype())
        return headers

    def read(self, key: str, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Checkpoint tensor ``key`` exactly as stored (cast to ``dtype`` if given), its file opened for this
        read only.

        Example:
            >>> # not run: needs files (a model directory)
            >>> src.read("model.norm.weight").shape  # doctest: +SKIP
            torch.Size([64])
        """
        from safetensors import safe_open

        with safe_open(str(self._files[key]), framework="pt") as fh:
            tensor = fh.get_tensor(key)
        self.reads += 1
        self.keys_read.add(key)
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    def _reader(self, name_dtype: torch.dtype) -> Callable[[str], Callable[[], Tensor]]:
        return lambda key: (lambda: self.read(key, name_dtype))

    def _meta_reader(self, name_dtype: torch.dtype) -> Callable[[str], Callable[[], Tensor]]:
        def reader(key: str) -> Callable[[], Tensor]:
            shape, _ = self._headers[key]
            return lambda: torch.empty(shape, dtype=name_dtype, device="meta")
        return reader

    def _run(self, group: _Group, reader: Callable[[str], Callable[[], Tensor]]) -> dict[str, Tensor]:
        if group.converter is None:
            return {group.target: reader(group.sources[0][1])()}
        if group.converter == _STACK:
            shape = self._shapes[group.target][0]
            full: Optional[Tensor] = None
            for i, (_, key) in enumerate(group.sources):
                part = reader(key)()
                if full is None:
                    full = torch.empty(shape, dtype=part.dtype, device=part.device)
                full[i].copy_(part)
                del part
            assert full is not None
            return {group.target: full}
        sources = [(pattern or "", key, reader(key)) for pattern, key in group.sources]
        with torch.no_grad():
            return convert_group(self._converters[group.converter], group.target, sources, _ShapeModel(self._shapes),
                                 self._config)

    # ------------------------------------------------------------------ mapping and checks
    def _map_keys(self, renamings: list[WeightRenaming], base_prefix: Optional[str],
                  model_keys: dict[str, Tensor]) -> tuple[dict[str, _Group], dict[str, str]]:
        """Groups by model name, and the keys that map to nothing (``{renamed: checkpoint key}``)."""
        pattern_index = {p: i for i, conv in enumerate(self._converters) for p in conv.source_patterns}
        sources: dict[str, list[tuple[Optional[str], str]]] = defaultdict(list)
        converter_of: dict[str, Optional[int]] = {}
        unexpected: dict[str, str] = {}
        for key in sorted(self._files, key=natural_key):
            renamed, pattern = rename_key(key, renamings, self._converters, base_prefix, model_keys)
            if renamed not in model_keys:
                unexpected[renamed] = key
                continue
            conv = pattern_index[pattern] if pattern is not None else None
            if renamed in converter_of and (conv is None or converter_of[renamed] != conv):
                first = sources[renamed][0][1]
                raise WeightMappingError(
                    f"{self.directory}: checkpoint keys {first} and {key} both map to {renamed} of "
                    f"{self._model_class}; keep one of them in the files.")
            converter_of[renamed] = conv
            sources[renamed].append((pattern, key))
        groups = {t: _Group(t, tuple(s), converter_of[t], (t,)) for t, s in sources.items()}
        return groups, unexpected

    def _missing(self, groups: dict[str, _Group], model_keys: dict[str, Tensor], aliases: dict[int, list[str]],
                 tensors: dict[str, Tensor]) -> list[str]:
        covered = {out for g in groups.values() for out in g.outputs}
        missing: list[str] = []
        for name in model_keys:
            if name in covered or name not in tensors:
                continue
            if any(alias in covered for alias in aliases[id(tensors[name])]):
                continue  # tied: loaded through another name
            missing.append(name)
        return missing

    def _stack_fallback(self, missing: list[str], unexpected: dict[str, str],
                        tensors: dict[str, Tensor]) -> dict[str, _Group]:
        """``….experts.NAME`` (``E × …``) from ``….experts.{i}.NAME[.weight]`` keys where transformers has no rule."""
        groups: dict[str, _Group] = {}
        for name in missing:
            shape = tuple(tensors[name].shape)
            if len(shape) < 2 or "." not in name:
                continue
            parent, leaf = name.rsplit(".", 1)
            rule = re.compile(rf"^{re.escape(parent)}\.(\d+)\.{re.escape(leaf)}(?:\.weight)?$")
            found = {int(m.group(1)): renamed for renamed in unexpected if (m := rule.match(renamed))}
            if sorted(found) != list(range(shape[0])):
                continue
            keys = [unexpected[found[i]] for i in range(shape[0])]
            if any(self._headers[k][0] != shape[1:] for k in keys):
                continue
            groups[name] = _Group(name, tuple((None, k) for k in keys), _STACK, (name,))
            for i in range(shape[0]):
                del unexpected[found[i]]
        return groups

    def _checked(self, groups: dict[str, _Group]) -> dict[str, _Group]:
        """Run every group on meta tensors (nothing read): shapes and converter outputs against the model; returns
        the groups with their outputs (several for a one-to-many converter)."""
        checked: dict[str, _Group] = {}
        for target, group in groups.items():
            dtype = self._shapes[target][1]
            if group.converter is None:
                key = group.sources[0][1]
                shapes = {target: self._headers[key][0]}
                what = f"checkpoint key {key}"
            else:
                keys = [k for _, k in group.sources]
                what = f"checkpoint keys {_shown(keys, 3)}"
                try:
                    shapes = {n: tuple(t.shape) for n, t in self._run(group, self._meta_reader(dtype)).items()}
                except Exception as err:  # re-raised with the keys named
                    raise WeightMappingError(
                        f"{self.directory}: transformers' conversion of {what} into {target} failed ({err}); are "
                        f"all experts / parts present in the files?") from err
            for name, shape in shapes.items():
                if name not in self._shapes:
                    raise WeightMappingError(f"{self.directory}: {what} convert to {name}, which {self._model_class} "
                                             f"does not have.")
                if shape != self._shapes[name][0]:
                    raise WeightMappingError(
                        f"{self.directory}: {what} hold shape {shape} for {name}, the model expects "
                        f"{self._shapes[name][0]}. Is the directory another model's (config.json and weights "
                        f"disagree)?")
            checked[target] = _Group(group.target, group.sources, group.converter, tuple(shapes))
        return checked


def _ignored(name: str, model: nn.Module, attribute: str) -> bool:
    patterns = getattr(model, attribute, None) or ()
    return any(re.search(p, name) for p in patterns)


def materialize_pretrained(module: nn.Module, device: Union[str, torch.device] = "cpu") -> nn.Module:
    """Allocate a meta-built ``module`` whole on ``device`` in one process: its initialisers run, then every
    ``fourd_weight_source`` in it (e.g. :meth:`lightning_4d.models.HFLogits.from_pretrained` under
    ``torch.device("meta")``) overwrites the tensors it holds. ``FourDStrategy`` does the same per shard; this is
    the single-process path (and the reference the sharded load is tested against). Returns ``module``.

    Example:
        >>> # not run: needs files (a model directory)
        >>> with torch.device("meta"):
        ...     net = HFLogits.from_pretrained("my-llama")  # doctest: +SKIP
        >>> materialize_pretrained(net)(tokens).shape  # doctest: +SKIP
        torch.Size([1, 5, 64])
    """
    from lightning_4d.materialize.local_shards import materialize_local_shards, meta_skeleton

    materialize_local_shards(meta_skeleton(module), module, torch.device(device))
    return module
