"""Hugging Face configs read offline, weight dtypes by name, and the record a checkpoint keeps of its model.

The facts both the model bridge (:mod:`lightning_4d.models.hf`) and the exporter
(:mod:`lightning_4d.checkpoint.hf_export`) need live here, below both, so neither imports the other: a
checkpoint stores the model's config as JSON under :data:`CHECKPOINT_KEY`, and an export rebuilds the
config with :func:`config_from_record` (no ``--base`` needed).

Example:
    >>> import transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
    ...                                num_hidden_layers=1, num_attention_heads=2)
    >>> config_from_record({"config": cfg.to_json_string()}).hidden_size
    8
    >>> resolve_dtype("bfloat16")
    torch.bfloat16
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["CHECKPOINT_KEY", "DTYPES", "PathLike", "config_from_record", "load_hf_config", "resolve_dtype"]

DTYPES: dict[str, Union[torch.dtype, str]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}
"""Weight dtypes by name; ``"auto"`` keeps the dtype of the saved weights (``config.json``'s ``dtype``)."""

CHECKPOINT_KEY = "hf_model"
"""Key of the record (:func:`lightning_4d.models.hf.checkpoint_record`) a :class:`~lightning_4d.models.CausalLM`
writes into its checkpoints, so an export needs no ``--base``."""

PathLike = Union[str, "os.PathLike[str]"]


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> Union[torch.dtype, str, None]:
    """A dtype name (``float32``, ``bfloat16``, ``float16``, ``auto``) or ``torch.dtype`` → what
    ``from_pretrained(dtype=...)`` accepts; ``None`` stays ``None``.

    Example:
        >>> resolve_dtype("bfloat16"), resolve_dtype(None)
        (torch.bfloat16, None)
        >>> resolve_dtype("fp8")
        Traceback (most recent call last):
        ...
        ValueError: dtype='fp8' is not one of float32, bfloat16, float16, auto; e.g. dtype=float32 for fp32 training.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}; e.g. dtype=float32 for fp32 training.")
    return DTYPES[dtype]


def load_hf_config(source: PathLike, trust_remote_code: bool = False) -> PreTrainedConfig:
    """The ``transformers`` config of a local model directory (holding ``config.json``) or of a config
    ``.json`` file, read offline.

    Raises:
        FileNotFoundError: ``source`` does not exist, or is a directory without ``config.json``.
        ValueError: the file is not a valid config (not JSON, no ``model_type``, unknown model type).

    Example:
        >>> load_hf_config("no/such/dir")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: no/such/dir does not exist: pass a local model directory (written by save_pretrained ...
    """
    from transformers import AutoConfig

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"{source} does not exist: pass a local model directory (written by save_pretrained or downloaded "
            f"beforehand, holding config.json) or a config .json file.")
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"{source} holds no config.json, so it is not a Hugging Face model directory; pass the directory that "
            f"save_pretrained wrote (config.json beside the *.safetensors files).")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON ({err}); pass a config.json written by save_pretrained.") from err
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{file} has no 'model_type', so transformers cannot tell which model it describes; "
                         f"pass a config.json written by save_pretrained.")
    try:
        return AutoConfig.from_pretrained(str(file.parent if path.is_dir() else file),
                                          trust_remote_code=trust_remote_code, local_files_only=True)
    except ValueError as err:
        hint = "" if trust_remote_code else " If the model ships its own code, set trust_remote_code=true."
        raise ValueError(f"{file}: transformers cannot build model_type={data['model_type']!r}: "
                         f"{str(err).splitlines()[0]}.{hint}") from err


def config_from_record(record: dict[str, Any]) -> PreTrainedConfig:
    """The ``transformers`` config saved by :func:`lightning_4d.models.hf.checkpoint_record` (no remote code is run).

    Example:
        >>> import transformers
        >>> cfg = transformers.GPT2Config(vocab_size=8, n_embd=8, n_layer=1, n_head=2)
        >>> type(config_from_record({"config": cfg.to_json_string()})).__name__
        'GPT2Config'
    """
    from transformers import CONFIG_MAPPING

    data = json.loads(record["config"])
    model_type = data.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"the recorded config has model_type={model_type!r}, which this transformers version does "
                         f"not know (remote code is never run from a checkpoint); pass the model directory as base.")
    return CONFIG_MAPPING[model_type].from_dict(data)
