"""Hugging Face ``transformers`` causal LMs as ``tokens -> logits`` networks that every layout rewrites.

:class:`HFLogits` is the whole bridge: it holds a ``…ForCausalLM`` built with
``AutoModelForCausalLM.from_pretrained(path)`` (or from a config alone, randomly initialised) and returns
``.logits`` from ``forward(tokens)``. ``FourDStrategy`` finds the embedding, the decoder layers, the
projections and the head by itself, so no other code is needed. Parameter names stay the model's own
(``model.layers.0.self_attn.q_proj.weight`` below the wrapper's ``model.``), so a checkpoint exports
back to a directory ``from_pretrained`` loads (:func:`lightning_4d.checkpoint.export_hf`).

Nothing is downloaded: sources are local directories (``save_pretrained`` output, or a downloaded
snapshot) or config JSON files.

Example:
    >>> import torch, transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                                num_hidden_layers=2, num_attention_heads=4)
    >>> net = HFLogits.from_config(cfg)
    >>> net(torch.zeros(1, 5, dtype=torch.long)).shape
    torch.Size([1, 5, 64])
    >>> from lightning_4d.models import CausalLM
    >>> lm = CausalLM(net, lr=1e-5)          # train it with FourDStrategy(tp=2, pp=2, ...)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from lightning_4d.analysis.hf_config import (CHECKPOINT_KEY, DTYPES, PathLike, config_from_record, load_hf_config,
                                    resolve_dtype)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "CHECKPOINT_KEY",
    "DTYPES",
    "HFLogits",
    "checkpoint_record",
    "config_from_record",
    "has_weights",
    "load_hf_config",
    "resolve_dtype",
]

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
"""Attention kernels that run on every device and under every layout (``flash_attention_2`` needs CUDA
and the ``flash-attn`` package; pass it through :meth:`HFLogits.from_pretrained` yourself if you have both)."""


def _check_attn(attn_implementation: str) -> None:
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)}: "
            f"use 'sdpa' (PyTorch's fused attention) or 'eager' (the model's reference code).")


def has_weights(directory: PathLike) -> bool:
    """Whether ``directory`` holds model weights (``*.safetensors``, ``pytorch_model*.bin`` or a shard index).

    Example:
        >>> has_weights("no/such/dir")
        False
    """
    directory = Path(directory)
    patterns = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
    return any(any(directory.glob(p)) for p in patterns)


class HFLogits(nn.Module):
    """A ``transformers`` causal LM as ``tokens (B, T) -> logits (B, T, V)``.

    Args:
        model: a ``…ForCausalLM`` (anything whose output has ``.logits``).
        source: the directory it was loaded from (recorded in checkpoints for the export), if any.

    The forward passes ``use_cache=False`` (no key-value cache while training). Build one with
    :meth:`from_pretrained` or :meth:`from_config`.

    Example:
        >>> import transformers
        >>> cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                num_hidden_layers=2, num_attention_heads=4, head_dim=8)
        >>> net = HFLogits.from_config(cfg, attn_implementation="eager")
        >>> sorted(net.state_dict())[0]
        'model.lm_head.weight'
    """

    def __init__(self, model: nn.Module, source: Optional[PathLike] = None) -> None:
        super().__init__()
        self.model = model
        self.source = str(Path(source).absolute()) if source is not None else None
        # Taken now: the parallel layouts change module attributes (head counts per rank), never the config,
        # but a snapshot keeps the export independent of anything done to the model later.
        self._config_json: str = model.config.to_json_string(use_diff=False)
        self._architecture = type(model).__name__  # before FSDP2 renames the class

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, T, V)`` for token ids ``(B, T)``. ``position_ids`` ``(B, T)`` of packed documents (restarting
        at 0 where one starts) go to the model: without an attention mask and cache, transformers' masks (sdpa,
        eager) then keep attention within each document (``masking_utils.find_packed_sequence_indices``)."""
        if position_ids is None:
            return self.model(input_ids=tokens, use_cache=False).logits
        return self.model(input_ids=tokens, position_ids=position_ids, use_cache=False).logits

    @classmethod
    def from_pretrained(cls, path: PathLike, dtype: Union[str, torch.dtype] = "float32",
                        attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                        meta: Optional[bool] = None) -> "HFLogits":
        """The model of a local directory, offline: loaded whole (``AutoModelForCausalLM.from_pretrained``), or
        built on the meta device with its weights streamed in later, shard by shard.

        Args:
            path: a directory with ``config.json`` and weights (``*.safetensors`` or ``pytorch_model*.bin``).
            dtype: ``float32`` (default: fp32 weights; Lightning's ``precision`` handles mixed precision),
                ``bfloat16``, ``float16`` or ``auto`` (the saved dtype). transformers' ``dtype``
                (formerly ``torch_dtype``).
            attn_implementation: ``sdpa`` (default) or ``eager``.
            trust_remote_code: run Python code shipped in the directory (off by default).
            meta: ``None`` (default): on the meta device when called under one (``with torch.device("meta")``,
                ``trainer.init_module(empty_init=True)``, a ``configure_model`` doing so), else loaded whole;
                ``True`` / ``False`` force either. On meta the model is built from its config
                (``AutoModelForCausalLM.from_config``, no memory) and carries an
                :class:`~lightning_4d.models.hf_source.HFWeightSource` as ``model.fourd_weight_source``:
                ``FourDStrategy`` then allocates only each rank's shards and reads their values straight from
                the safetensors files, one tensor at a time (peak per rank ≈ its share + one tensor);
                :func:`~lightning_4d.models.hf_source.materialize_pretrained` does it in one process. Needs
                ``*.safetensors`` files (single-file or sharded with ``model.safetensors.index.json``).

        Raises:
            FileNotFoundError: no such directory, no ``config.json``, or no weight files (on meta: no
                safetensors files).
            lightning_4d.models.hf_source.WeightMappingError: on meta, files that do not fit the model (shapes,
                keys transformers cannot map), found from the files' headers before anything is allocated.

        Example:
            >>> # not run: needs files (a model directory)
            >>> net = HFLogits.from_pretrained("my-llama", dtype="bfloat16")  # doctest: +SKIP
            >>> with torch.device("meta"):
            ...     net = HFLogits.from_pretrained("my-llama")  # doctest: +SKIP
            >>> net.model.fourd_weight_source  # doctest: +SKIP
            HFWeightSource('/data/my-llama', 26 tensors from 1 file(s), missing=0, unexpected=0)
        """
        from transformers import AutoModelForCausalLM

        directory = Path(path)
        config = load_hf_config(directory, trust_remote_code)
        if not directory.is_dir():
            raise FileNotFoundError(f"{path} is a file: from_pretrained needs the model directory (config.json and "
                                    f"weights); to build a random model from a config file use from_config.")
        if not has_weights(directory):
            raise FileNotFoundError(
                f"{path} holds config.json but no weights (*.safetensors or pytorch_model*.bin); save the model with "
                f"save_pretrained, or build a randomly initialised one from the config with from_config.")
        _check_attn(attn_implementation)
        if meta is None:
            meta = torch.get_default_device().type == "meta"
        if meta:
            return cls._streamed(directory, config, dtype, attn_implementation, trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), config=config, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code, local_files_only=True)
        return cls(model, source=directory)

    @classmethod
    def _streamed(cls, directory: Path, config: PreTrainedConfig, dtype: Union[str, torch.dtype],
                  attn_implementation: str, trust_remote_code: bool) -> "HFLogits":
        """Built on meta from ``config``, with the directory's weights attached as its ``fourd_weight_source``."""
        from transformers import AutoModelForCausalLM

        from lightning_4d.models.hf_source import HFWeightSource, safetensors_dtype

        resolved = resolve_dtype(dtype)
        if resolved == "auto":  # as from_pretrained: config.json's dtype, else the files' first floating dtype
            saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
            resolved = getattr(torch, saved) if isinstance(saved, str) else saved
            resolved = resolved or safetensors_dtype(directory) or torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=resolved, attn_implementation=attn_implementation,
                                                     trust_remote_code=trust_remote_code)
        model.fourd_weight_source = HFWeightSource(directory, model)
        source = model.fourd_weight_source
        if source.missing or source.unexpected:
            from lightning.fabric.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(f"HFLogits.from_pretrained: {source.describe()}")
        return cls(model, source=directory)

    @classmethod
    def from_config(cls, config: Union[PathLike, PreTrainedConfig], dtype: Union[str, torch.dtype] = "float32",
                    attn_implementation: str = "sdpa", trust_remote_code: bool = False) -> "HFLogits":
        """A randomly initialised model (seeded by the caller) from a config object, a model directory or a
        config ``.json`` file; for tests and training from scratch.

        Example:
            >>> from transformers import LlamaConfig
            >>> net = HFLogits.from_config(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
            >>> type(net.model).__name__, net(torch.zeros(1, 4, dtype=torch.long)).shape
            ('LlamaForCausalLM', torch.Size([1, 4, 32]))
        """
        from transformers import AutoModelForCausalLM

        source = None
        if isinstance(config, (str, os.PathLike)):
            source = Path(config) if Path(config).is_dir() else None
            config = load_hf_config(config, trust_remote_code)
        _check_attn(attn_implementation)
        resolved = resolve_dtype(dtype)
        kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
        if resolved not in (None, "auto"):
            kwargs["dtype"] = resolved
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError as err:
            raise ValueError(f"{type(config).__name__} (model_type={getattr(config, 'model_type', '?')!r}) has no "
                             f"causal-LM class in transformers: {str(err).splitlines()[0]}") from err
        return cls(model, source=source)

    def record(self) -> dict[str, Optional[str]]:
        """What an export needs to rebuild the model: the config (JSON text) and the source directory.

        Example:
            >>> import transformers
            >>> cfg = transformers.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
            ...                                num_hidden_layers=1, num_attention_heads=2)
            >>> sorted(HFLogits.from_config(cfg).record())
            ['architecture', 'base', 'config']
        """
        return {"config": self._config_json, "base": self.source, "architecture": self._architecture}


def checkpoint_record(module: nn.Module) -> Optional[dict[str, Optional[str]]]:
    """The :meth:`HFLogits.record` of the first :class:`HFLogits` inside ``module`` (``None``: there is none).

    A LightningModule of your own records it in its checkpoints with::

        def on_save_checkpoint(self, checkpoint):
            record = checkpoint_record(self)
            if record is not None:
                checkpoint[CHECKPOINT_KEY] = record

    Example:
        >>> checkpoint_record(nn.Linear(2, 2)) is None
        True
    """
    for sub in module.modules():
        if isinstance(sub, HFLogits):
            return sub.record()
    return None
