"""Consolidated export / import: one safetensors file with the model's parameter names.

A sharded checkpoint (any layout) is merged without a process group by DCP's own converter; stacked
MoE experts (``...experts.w1`` of shape ``[E, F, H]``) are split per expert into Mixtral / Hugging Face
style names (``...experts.{i}.w1.weight``). Importing stacks them back when the target model keeps
experts stacked, so a consolidated file can seed a run under any layout.

Example:
    >>> export_consolidated("ckpts/step=10.ckpt", "model.safetensors")  # doctest: +SKIP
    >>> import_consolidated(lightning_module, "model.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch
from torch import nn

__all__ = ["export_consolidated", "import_consolidated", "split_experts", "stack_experts", "read_model_state"]

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


def read_model_state(checkpoint: str | os.PathLike, verify: bool = True) -> dict[str, torch.Tensor]:
    """The full model state of a sharded checkpoint, merged in one process (no process group).

    Every file is first checked against the checkpoint's manifest (``verify=False``: sizes only); a
    damaged one raises :class:`~lightning_4d.checkpoint.state.CheckpointIntegrityError` naming it.

    Example:
        >>> sorted(read_model_state("ckpts/last.ckpt"))[:1]  # doctest: +SKIP
        ['model.layers.0.attention.wk.weight']
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_4d.checkpoint.state import CheckpointIntegrityError, check_checkpoint, verify_checkpoint

    check_checkpoint(checkpoint)
    try:
        verify_checkpoint(checkpoint, checksums=verify)
    except CheckpointIntegrityError as err:
        raise CheckpointIntegrityError(f"Could not read checkpoint {checkpoint}: {err}") from err
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "full.pt"
        try:
            dcp_to_torch_save(str(checkpoint), str(target))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
            detail = " ".join(str(err).split())
            missing = re.search(r"No such file or directory: '([^']+)'", detail)
            cause = f"{missing.group(1)} is missing" if missing else detail[:300]
            raise ValueError(f"Could not read checkpoint {checkpoint}: {cause}.") from err
        full = torch.load(target, weights_only=False, map_location="cpu")
    model = full["model"] if "model" in full else full
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def export_consolidated(checkpoint: str | os.PathLike, out: str | os.PathLike, verify: bool = True) -> Path:
    """Write the checkpoint's model as one safetensors file, experts split per expert.

    The checkpoint's files are verified against its manifest first (``verify=False``: sizes only); the
    directory of ``out`` is created when missing.

    Example:
        >>> export_consolidated("ckpts/last.ckpt", "model.safetensors")  # doctest: +SKIP
    """
    from safetensors.torch import save_file

    state = split_experts(read_model_state(checkpoint, verify=verify))
    target = Path(out)
    if target.is_dir():
        raise ValueError(f"{out} is a directory: pass the .safetensors file to write, e.g. {target / 'model.safetensors'}.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".partial")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, target)  # never a half-written file under the final name
    return target


@torch.no_grad()
def import_consolidated(module: nn.Module, path: str | os.PathLike, strict: bool = True) -> None:
    """Load a consolidated file into an unsharded module (before ``trainer.fit``); experts are re-stacked.

    Raises ``ValueError`` naming the keys when names or shapes do not match the module.

    Example:
        >>> import_consolidated(lightning_module, "model.safetensors")  # doctest: +SKIP
    """
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a file written by export_consolidated.")
    own = module.state_dict()
    state = stack_experts(load_file(str(path)), set(own))
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

