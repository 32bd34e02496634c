"""The recipes' view of a Hugging Face model (``model=hf``): its config, shape, planner spec, parameter count
and the network (:func:`build_hf`, the ``_target_`` of ``conf/model/hf.yaml``).

Read from ``config.json`` only (offline, nothing allocated: the parameter count comes from a build on the
meta device), so the fail-fast checks of :mod:`lightning_4d.recipes.build` and
:mod:`lightning_4d.recipes.resources` treat ``model=hf`` like the built-in models. Every error is a
:class:`~lightning_4d.recipes.schema.RecipeConfigError` naming ``model.path`` / ``model.config``.

Example:
    >>> from lightning_4d.recipes.schema import HFModelConfig
    >>> hf_shape(HFModelConfig(path="my-llama")).num_hidden_layers  # doctest: +SKIP
    32
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from lightning_4d.recipes.schema import HFModelConfig, RecipeConfigError

__all__ = ["HFShape", "build_hf", "hf_config", "hf_param_count", "hf_shape", "hf_spec"]

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_PARAM = re.compile(r"(^|\.)experts(\.|$)")


@lru_cache(maxsize=16)
def _load(source: str, trust_remote_code: bool, need_weights: bool) -> Any:
    from lightning_4d.models.hf import has_weights, load_hf_config

    config = load_hf_config(source, trust_remote_code)
    if need_weights:
        if not Path(source).is_dir():
            raise FileNotFoundError(f"{source} is a file: model.path needs the model directory (config.json and "
                                    f"weights); for a random model from a config file use model.config={source}.")
        if not has_weights(source):
            raise FileNotFoundError(
                f"{source} holds config.json but no weights (*.safetensors or pytorch_model*.bin); write them with "
                f"save_pretrained, or use model.config={source} for a randomly initialised model.")
    return config


def hf_config(model: HFModelConfig) -> Any:
    """The ``transformers`` config of ``model.path`` (which must also hold weights) or ``model.config``.

    Raises:
        RecipeConfigError: the path does not exist, holds no ``config.json`` (or, for ``model.path``, no
            weights), or the config is not valid.

    Example:
        >>> hf_config(HFModelConfig(path="nowhere"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.schema.RecipeConfigError: model.path='nowhere': nowhere does not exist: ...
    """
    source = str(Path(model.source).absolute())
    try:
        return _load(source, model.trust_remote_code, model.path is not None)
    except (FileNotFoundError, ValueError) as err:
        raise RecipeConfigError(f"{model.source_key}={model.source!r}: {str(err).replace(source, model.source)}") \
            from None


@dataclass(frozen=True)
class HFShape:
    """What the layout checks need from a Hugging Face config.

    Example:
        >>> HFShape(vocab_size=64, max_positions=None, num_attention_heads=4, num_key_value_heads=2,
        ...         num_hidden_layers=2, num_experts=None, top_k=1).num_hidden_layers
        2
    """

    vocab_size: int
    max_positions: Optional[int]
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    num_experts: Optional[int]
    top_k: int


def hf_shape(model: HFModelConfig) -> HFShape:
    """Vocabulary, positions, heads, blocks and experts of ``model``'s config.

    Example:
        >>> hf_shape(HFModelConfig(config="my-qwen3-moe/config.json")).num_experts  # doctest: +SKIP
        8
    """
    cfg = hf_config(model)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    experts = next((int(getattr(text, k)) for k in _EXPERT_KEYS if isinstance(getattr(text, k, None), int)), None)
    return HFShape(
        vocab_size=int(text.vocab_size),
        max_positions=getattr(text, "max_position_embeddings", None),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        num_hidden_layers=int(text.num_hidden_layers),
        num_experts=experts or None,
        top_k=int(getattr(text, "num_experts_per_tok", 1) or 1),
    )


def hf_spec(model: HFModelConfig) -> Any:
    """The planner's :class:`~lightning_4d.planner.TransformerSpec` of ``model``'s config (exact in the heads,
    blocks and experts the layout rules read; the widths of a Llama-style block for the memory model), or
    ``None`` when the config does not describe such a block.

    Example:
        >>> hf_spec(HFModelConfig(path="my-llama")).layers  # doctest: +SKIP
        32
    """
    from lightning_4d.planner import TransformerSpec

    shape, cfg = hf_shape(model), hf_config(model)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    experts = shape.num_experts or 0
    ffn = getattr(text, "intermediate_size", None)
    try:
        return TransformerSpec(
            shape.vocab_size, int(text.hidden_size), shape.num_hidden_layers, shape.num_attention_heads,
            shape.num_key_value_heads, ffn, num_experts=experts, top_k=shape.top_k if experts else 0,
            expert_hidden=int(getattr(text, "moe_intermediate_size", None) or ffn or 0) if experts else 0,
            tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)), name=model.name)
    except (AttributeError, TypeError, ValueError):
        return None


def build_hf(model: HFModelConfig) -> Any:
    """:class:`~lightning_4d.models.HFLogits` of ``model.path`` (pretrained) or ``model.config`` (random init).

    Example:
        >>> type(build_hf(HFModelConfig(config="my-llama/config.json"))).__name__  # doctest: +SKIP
        'HFLogits'
    """
    from lightning_4d.models.hf import HFLogits

    hf_config(model)  # clear errors for a missing path / config.json / weights
    options = dict(dtype=model.dtype, attn_implementation=model.attn_implementation,
                   trust_remote_code=model.trust_remote_code)
    load = HFLogits.from_pretrained if model.path is not None else HFLogits.from_config
    return load(Path(model.source).absolute(), **options)


def hf_param_count(model: HFModelConfig) -> Any:
    """Exact parameters of ``model`` (a :class:`~lightning_4d.recipes.resources.ParamCount`) from a build
    on the meta device (no memory); tied weights count once, routed experts (``…experts…`` parameters) as
    ``expert`` and ``top_k / num_experts`` of them as active.

    Example:
        >>> hf_param_count(HFModelConfig(path="my-llama")).expert  # doctest: +SKIP
        0
    """
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_4d.recipes.resources import ParamCount

    shape = hf_shape(model)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(hf_config(model), trust_remote_code=model.trust_remote_code)
    dense = expert = 0
    for name, param in net.named_parameters():
        if _EXPERT_PARAM.search(name):
            expert += param.numel()
        else:
            dense += param.numel()
    active = dense + (expert * shape.top_k // shape.num_experts if shape.num_experts else expert)
    return ParamCount(dense=dense, expert=expert, active=active)
