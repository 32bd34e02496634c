"""Export a sharded checkpoint of a Hugging Face model to a directory ``from_pretrained`` loads.

The checkpoint (any layout) is merged into full tensors (:func:`~lightning_4d.checkpoint.read_model_state`,
files verified against the manifest), the LightningModule's and wrapper's prefixes are stripped so the
names equal ``AutoModelForCausalLM.from_pretrained(base).state_dict()``'s, the model is rebuilt from its
config and loaded strictly, and ``save_pretrained`` writes ``config.json`` and safetensors (tied weights
and transformers' on-disk conversions handled by transformers itself). Tokenizer, chat-template and
generation-config files are copied from the base directory when there is one.

Where the config comes from: ``base`` (a model directory) when given; otherwise the record a
:class:`~lightning_4d.models.CausalLM` around an :class:`~lightning_4d.models.HFLogits` writes into every
checkpoint (the config JSON and the directory it was loaded from).

Example:
    >>> export_hf("outputs/run/checkpoints/step=100.ckpt", "my-finetuned-llama")  # doctest: +SKIP
    PosixPath('my-finetuned-llama')
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

__all__ = ["SIDE_FILES", "export_hf", "load_strict", "strip_prefix"]

PathLike = Union[str, "os.PathLike[str]"]

SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
"""Files copied from the base directory beside the exported weights (those present)."""


def _names(keys: Iterable[str], limit: int = 6) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", … ({len(keys)} in all)" if len(keys) > limit else "")


def strip_prefix(state: dict[str, Any], own_keys: Iterable[str]) -> tuple[str, dict[str, Any]]:
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
    aliases = _aliases(model)
    full = dict(state)
    for key in set(own) - set(state):
        present = [a for a in aliases.get(key, []) if a in state]
        if present:
            full[key] = state[present[0]]
    missing = sorted(set(own) - set(full))
    unexpected = sorted(set(full) - set(own))
    shapes = [f"{k} {tuple(full[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(set(own) & set(full))
              if tuple(full[k].shape) != tuple(own[k].shape)]
    problems = [part for part in (
        f"{len(missing)} missing keys ({_names(missing)})" if missing else "",
        f"{len(unexpected)} unexpected keys ({_names(unexpected)})" if unexpected else "",
        f"{len(shapes)} shape mismatches (checkpoint vs model: {'; '.join(shapes[:4])})" if shapes else "") if part]
    if problems:
        raise ValueError(f"{source} does not match {type(model).__name__}: {'; '.join(problems)}. Is it a checkpoint "
                         f"of another model (other depth, sizes or names)?")
    model.load_state_dict(full, strict=True)


def _meta_record(checkpoint: Path) -> Optional[dict[str, Any]]:
    from lightning_4d.checkpoint.state import META_FILE, _load_file
    from lightning_4d.models.hf import CHECKPOINT_KEY

    meta = _load_file(checkpoint / META_FILE)
    record = meta.get(CHECKPOINT_KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, dict) and "config" in record else None


def _resolve(checkpoint: Path, base: Optional[PathLike]) -> tuple[Any, Optional[Path]]:
    """The model config and the directory side files come from."""
    from lightning_4d.models.hf import config_from_record, load_hf_config

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


def _empty_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with uninitialised CPU storage: no time spent on a random init, every
    persistent tensor is then loaded. Only written to files (non-persistent buffers such as rotary tables
    stay uninitialised), never run."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage: tie them again
    return model


def _dtype_of(state: dict[str, torch.Tensor]) -> torch.dtype:
    floats = [v.dtype for v in state.values() if v.is_floating_point()]
    return Counter(floats).most_common(1)[0][0] if floats else torch.float32


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


def export_hf(checkpoint: PathLike, out: PathLike, base: Optional[PathLike] = None, verify: bool = True,
              dtype: Optional[Union[str, torch.dtype]] = None) -> Path:
    """Write a sharded checkpoint of a Hugging Face causal LM as a ``save_pretrained`` directory.

    Args:
        checkpoint: a checkpoint directory written by ``FourDStrategy`` (any layout).
        out: the directory to create (refused when it exists and is not empty); written under
            ``<out>.partial`` and renamed when complete.
        base: the model directory trained from (config, tokenizer files). Optional for checkpoints of a
            :class:`~lightning_4d.models.CausalLM` around :class:`~lightning_4d.models.HFLogits`, which
            record the config and that directory.
        verify: check every checkpoint file's SHA-256 against the manifest (``False``: sizes only).
        dtype: ``float32``, ``bfloat16`` or ``float16`` to cast the weights to (``None``: as trained).

    Returns:
        ``out``; ``AutoModelForCausalLM.from_pretrained(out)`` loads it.

    Raises:
        ValueError: the checkpoint's names or shapes do not match the config's model (naming the keys), no
            config is recorded and no ``base`` given, or ``out`` is not empty.

    Example:
        >>> export_hf("ckpts/last.ckpt", "exported", base="pretrained/llama")  # doctest: +SKIP
        PosixPath('exported')
    """
    from lightning_4d.checkpoint.consolidate import read_model_state
    from lightning_4d.checkpoint.state import check_checkpoint
    from lightning_4d.models.hf import resolve_dtype

    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty directory: choose a new output directory or "
                         f"remove it first.")
    cast = resolve_dtype(dtype)
    if cast == "auto":
        cast = None
    ckpt = check_checkpoint(checkpoint)
    config, base_dir = _resolve(ckpt, base)
    state = read_model_state(ckpt, verify=verify)
    build_dtype = cast if isinstance(cast, torch.dtype) else _dtype_of(state)
    model = _empty_model(config, build_dtype)
    _, state = strip_prefix(state, model.state_dict())
    if isinstance(cast, torch.dtype):
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    load_strict(model, state, source=str(checkpoint))
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    _copy_side_files(base_dir, tmp)
    if target.exists():
        target.rmdir()  # empty (checked above)
    os.replace(tmp, target)  # never a half-written directory under the final name
    return target
