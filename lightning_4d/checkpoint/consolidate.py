"""Consolidated export / import: safetensors with the model's parameter names.

A sharded checkpoint (any layout) is read without a process group, one tensor at a time
(:class:`~lightning_4d.checkpoint.stream.CheckpointReader`), and written one tensor at a time to one file
or to Hugging Face's sharded layout (:class:`~lightning_4d.checkpoint.stream.SafetensorsWriter`); stacked
MoE experts (``...experts.w1`` of shape ``[E, F, H]``) are split per expert into Mixtral / Hugging Face
style names (``...experts.{i}.w1.weight``). Importing stacks them back when the target model keeps
experts stacked, so a consolidated file can seed a run under any layout.

Example:
    >>> # not run: needs files (a checkpoint)
    >>> export_consolidated("ckpts/step=10.ckpt", "model.safetensors")  # doctest: +SKIP
    >>> import_consolidated(lightning_module, "model.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Union

import torch
from torch import nn

from lightning_4d.checkpoint.stream import (DEFAULT_MAX_SHARD_SIZE, SAFE_WEIGHTS_INDEX, CheckpointReader,
                                            SafetensorsWriter, TensorSpec, atomic_directory, check_new_directory,
                                            parse_size, plan_shards, write_index)

__all__ = ["expert_specs", "export_consolidated", "import_consolidated", "open_checkpoint", "read_model_state",
           "split_experts", "stack_experts"]

_STACKED = re.compile(r"^(?P<prefix>.*experts)\.(?P<w>w[123])$")
_SPLIT = re.compile(r"^(?P<prefix>.*experts)\.(?P<i>\d+)\.(?P<w>w[123])\.weight$")


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``experts.w1 [E, F, H]`` → ``experts.{i}.w1.weight [F, H]`` (pure).

    Example:
        >>> sorted(split_experts({"l.experts.w1": torch.zeros(2, 3, 4)}))
        ['l.experts.0.w1.weight', 'l.experts.1.w1.weight']
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _STACKED.match(key)
        if match and value.dim() == 3:
            for i in range(value.shape[0]):
                out[f"{match['prefix']}.{i}.{match['w']}.weight"] = value[i].clone()
        else:
            out[key] = value
    return out


def stack_experts(state: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_experts` for the stacked keys in ``wanted`` (pure).

    Example:
        >>> s = split_experts({"l.experts.w1": torch.arange(24.).view(2, 3, 4)})
        >>> stack_experts(s, {"l.experts.w1"})["l.experts.w1"].shape
        torch.Size([2, 3, 4])
    """
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _SPLIT.match(key)
        stacked = f"{match['prefix']}.{match['w']}" if match else None
        if match and stacked in wanted:
            groups.setdefault(stacked, {})[int(match["i"])] = value
        else:
            out[key] = value
    for key, parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"{key}: experts {sorted(parts)} are not 0..{len(parts) - 1}; the file is incomplete.")
        out[key] = torch.stack([parts[i] for i in range(len(parts))])
    return out


def open_checkpoint(checkpoint: str | os.PathLike, verify: bool = True) -> CheckpointReader:
    """Check that ``checkpoint`` is complete and intact, and open it for reading one tensor at a time.

    Every file is first checked against the checkpoint's manifest (``verify=False``: sizes only); a
    damaged one raises :class:`~lightning_4d.checkpoint.state.CheckpointIntegrityError` naming it.

    Example:
        >>> # not run: needs files (a checkpoint)
        >>> reader = open_checkpoint("ckpts/last.ckpt")  # doctest: +SKIP
        >>> sorted(reader.specs)[:1]  # doctest: +SKIP
        ['model.layers.0.attention.wk.weight']
    """
    from lightning_4d.checkpoint.state import CheckpointIntegrityError, check_checkpoint, verify_checkpoint

    check_checkpoint(checkpoint)
    try:
        verify_checkpoint(checkpoint, checksums=verify)
    except CheckpointIntegrityError as err:
        raise CheckpointIntegrityError(f"Could not read checkpoint {checkpoint}: {err}") from err
    reader = CheckpointReader(checkpoint)
    if not reader.specs:
        raise ValueError(f"Could not read checkpoint {checkpoint}: it holds no model tensors.")
    return reader


def read_model_state(checkpoint: str | os.PathLike, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full model state of a sharded checkpoint, merged in one process (no process group).

    Holds the whole model in memory: to write it to files, :func:`export_consolidated` streams it instead.
    Files are verified as by :func:`open_checkpoint`.

    Example:
        >>> # not run: needs files (a checkpoint)
        >>> sorted(read_model_state("ckpts/last.ckpt"))[:1]  # doctest: +SKIP
        ['model.layers.0.attention.wk.weight']
    """
    reader = open_checkpoint(checkpoint, verify=verify)
    return {name: reader.read(name) for name in reader.specs}


def expert_specs(name: str, spec: TensorSpec) -> list[tuple[str, TensorSpec]]:
    """The names and specs :func:`split_experts` gives ``name`` (itself when it is not stacked experts).

    Example:
        >>> [n for n, _ in expert_specs("l.experts.w1", TensorSpec((2, 3, 4), torch.float32))]
        ['l.experts.0.w1.weight', 'l.experts.1.w1.weight']
    """
    match = _STACKED.match(name)
    if match and len(spec.shape) == 3:
        return [(f"{match['prefix']}.{i}.{match['w']}.weight", TensorSpec(spec.shape[1:], spec.dtype))
                for i in range(spec.shape[0])]
    return [(name, spec)]


def export_consolidated(checkpoint: str | os.PathLike, out: str | os.PathLike, verify: bool = True,
                        max_shard_size: Union[int, str, None] = None) -> Path:
    """Write the checkpoint's model to safetensors, experts split per expert, one tensor at a time.

    ``out`` ending in ``.safetensors``: one file (its directory is created when missing). Any other ``out``:
    a directory (absent or empty) in Hugging Face's layout, ``model.safetensors`` or, above
    ``max_shard_size`` (default ``"50GB"``, as ``save_pretrained``), ``model-0000k-of-0000n.safetensors``
    and ``model.safetensors.index.json``. Memory: about twice the largest tensor of the checkpoint (a stacked
    expert tensor counts whole), not the model. The checkpoint's files are verified against its manifest
    first (``verify=False``: sizes only); the output is written under ``<out>.partial`` and renamed when
    every tensor is written and every file's header read back.

    Example:
        >>> # not run: needs files (a checkpoint)
        >>> export_consolidated("ckpts/last.ckpt", "model.safetensors")  # doctest: +SKIP
        PosixPath('model.safetensors')
        >>> export_consolidated("ckpts/last.ckpt", "exported", max_shard_size="5GB")  # doctest: +SKIP
        PosixPath('exported')
    """
    target = Path(out)
    single = target.suffix == ".safetensors"
    if single and target.is_dir():
        raise ValueError(f"{out} is a directory: pass the .safetensors file to write, e.g. "
                         f"{target / 'model.safetensors'}.")
    if single and max_shard_size is not None:
        raise ValueError(f"max_shard_size={max_shard_size!r} applies to a directory export, not to the single file "
                         f"{out}: pass a directory (no .safetensors suffix) or drop max_shard_size.")
    if not single:
        check_new_directory(target)
        parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)  # fail before reading
    reader = open_checkpoint(checkpoint, verify=verify)
    outputs = {name: expert_specs(name, spec) for name, spec in reader.specs.items()}
    specs = {n: s for pieces in outputs.values() for n, s in pieces}
    if len(specs) != sum(len(pieces) for pieces in outputs.values()):
        raise ValueError(f"{checkpoint} holds both stacked experts and per-expert tensors of the same name; the "
                         f"split names would collide.")

    def write(directory: Path, layout: dict[str, dict[str, TensorSpec]]) -> None:
        with SafetensorsWriter(directory, layout) as writer:
            for name, pieces in outputs.items():
                value = reader.read(name)
                if len(pieces) == 1 and pieces[0][0] == name:
                    writer.write(name, value)
                else:
                    for i, (piece, _) in enumerate(pieces):
                        writer.write(piece, value[i])
                del value

    if not single:
        with atomic_directory(target) as tmp:
            layout = plan_shards(specs, DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
            write(tmp, layout)
            if len(layout) > 1:
                write_index(tmp, layout)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.name + ".partial"
    try:
        write(target.parent, {partial: specs})
    except BaseException:
        (target.parent / partial).unlink(missing_ok=True)
        raise
    os.replace(target.parent / partial, target)  # never a half-written file under the final name
    return target


def _consolidated_files(path: Path) -> list[Path]:
    """The safetensors files of a consolidated export: the file itself, or a directory's shards."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist: pass a file or directory written by export_consolidated.")
    index = path / SAFE_WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise FileNotFoundError(f"{path} holds neither {SAFE_WEIGHTS_INDEX} nor model.safetensors: pass a file or "
                            f"directory written by export_consolidated.")


@torch.no_grad()
def import_consolidated(module: nn.Module, path: str | os.PathLike, strict: bool = True) -> None:
    """Load a consolidated file (or a directory of shards) into an unsharded module (before ``trainer.fit``);
    experts are re-stacked.

    Raises ``ValueError`` naming the keys when names or shapes do not match the module.

    Example:
        >>> # not run: needs files (a checkpoint)
        >>> import_consolidated(lightning_module, "model.safetensors")  # doctest: +SKIP
    """
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = {}
    for file in _consolidated_files(Path(path)):
        loaded.update(load_file(str(file)))
    own = module.state_dict()
    state = stack_experts(loaded, set(own))
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise ValueError(
            f"{path} does not match {type(module).__name__}: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]}. Is it a checkpoint of another model?"
        )
    for key, value in state.items():
        if key in own and own[key].shape != value.shape:
            raise ValueError(f"{path}: {key} has shape {tuple(value.shape)}, the model expects {tuple(own[key].shape)}.")
    module.load_state_dict(state, strict=strict)

