"""The recipes' view of a Hugging Face model (``model=hf``): its config, shape, planner spec, parameter count
and the network (:func:`build_hf`, the ``_target_`` of ``conf/model/hf.yaml``).

Read from ``config.json`` only (offline, nothing allocated: the parameter count comes from a build on the
meta device), so the fail-fast checks of :mod:`lightning_4d.recipes.build` and
:mod:`lightning_4d.recipes.resources` treat ``model=hf`` like the built-in models. Every error is a
:class:`~lightning_4d.recipes.errors.RecipeConfigError` naming ``model.path`` / ``model.config``.

Example:
    >>> from lightning_4d.recipes.schema import HFModelConfig
    >>> # not run: needs files (a model directory or config file)
    >>> hf_shape(HFModelConfig(path="my-llama")).num_hidden_layers  # doctest: +SKIP
    32
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_4d.recipes.counts import ParamCount
from lightning_4d.recipes.schema import HFModelConfig, RecipeConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from lightning_4d.models.hf import HFLogits
    from lightning_4d.planner import TransformerSpec

__all__ = ["HFShape", "build_hf", "hf_config", "hf_config_with_layers", "hf_param_count", "hf_shape", "hf_spec",
           "hf_spec_notes"]

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_PARAM = re.compile(r"(^|\.)experts(\.|$)")


@lru_cache(maxsize=16)
def _load(source: str, trust_remote_code: bool, need_weights: bool) -> PreTrainedConfig:
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


def hf_config(model: HFModelConfig) -> PreTrainedConfig:
    """The ``transformers`` config of ``model.path`` (which must also hold weights) or ``model.config``.

    Raises:
        RecipeConfigError: the path does not exist, holds no ``config.json`` (or, for ``model.path``, no
            weights), or the config is not valid.

    Example:
        >>> hf_config(HFModelConfig(path="nowhere"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.errors.RecipeConfigError: model.path='nowhere': nowhere does not exist: ...
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
        >>> # not run: needs files (a model directory or config file)
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


def _attention_kind(text: PreTrainedConfig) -> str:
    """``TransformerSpec.attention`` of a text config: ``softcap`` for attention logit soft-capping and ``alibi``
    for ALiBi models (context parallelism refuses both), ``sliding_window`` when it declares one for any layer (as
    :func:`~lightning_4d.context_parallel.check.declared_sliding_window` reads it), else ``causal``."""
    from lightning_4d.context_parallel.check import declared_sliding_window

    cap = getattr(text, "attn_logit_softcapping", None)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap:
        return "softcap"
    if getattr(text, "alibi", False) or str(getattr(text, "model_type", "")) in ("bloom", "mpt"):
        return "alibi"
    if declared_sliding_window(text) is not None:
        return "sliding_window"
    return "causal"


def _spec_fields(text: PreTrainedConfig) -> tuple[dict[str, Any], list[str]]:
    """:class:`~lightning_4d.planner.TransformerSpec` keyword arguments of a ``transformers`` text config and what
    they leave out (pure; duck-typed on the config's attributes).

    Read: the Llama-style block (``hidden_size``, heads, ``head_dim``, ``intermediate_size``, ``attention_bias``,
    q/k norms of Qwen3 / OLMo 2), GPT-2 (``n_embd``: LayerNorm with biases, GeLU MLP, fused ``c_attn``, learned
    positions), the MoE layers of Mixtral (every block), Qwen2/3-MoE (``decoder_sparse_step``, a prefix of
    ``mlp_only_layers``, shared experts of ``shared_expert_intermediate_size``) and DeepSeek-V3
    (``first_k_dense_replace``, ``n_shared_experts``; its latent attention is planned as full heads).
    """
    notes: list[str] = []
    model_type = str(getattr(text, "model_type", ""))
    h, layers = int(text.hidden_size), int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kw: dict[str, Any] = dict(vocab_size=int(text.vocab_size), hidden=h, layers=layers, heads=heads,
                              kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                              tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
                              seq_len=int(getattr(text, "max_position_embeddings", None) or 2048))
    if model_type == "gpt2":
        inner = getattr(text, "n_inner", None) or 4 * h
        kw.update(ffn_hidden=int(inner), gated_mlp=False, norm="layernorm", norm_bias=True, qkv_bias=True,
                  out_bias=True, mlp_bias=True, learned_positions=kw["seq_len"], fused_qkv=True)
        return kw, notes
    head_dim = getattr(text, "head_dim", None)
    if head_dim and int(head_dim) * heads != h:
        kw["head_size"] = int(head_dim)
    kw["qkv_bias"] = bool(getattr(text, "attention_bias", False) or model_type.startswith("qwen2"))
    kw["out_bias"] = bool(getattr(text, "attention_bias", False)) and not model_type.startswith("qwen2")
    kw["mlp_bias"] = bool(getattr(text, "mlp_bias", False))
    kw["qk_norm"] = model_type.startswith(("qwen3", "olmo2"))
    if getattr(text, "q_lora_rank", None) is not None or getattr(text, "kv_lora_rank", None) is not None:
        notes.append("multi-head latent attention is planned as full-width heads (its low-rank projections are "
                     "not modelled)")
    ffn = getattr(text, "intermediate_size", None)
    kw["ffn_hidden"] = int(ffn) if ffn else None
    kw["attention"] = _attention_kind(text)
    experts = next((int(getattr(text, k)) for k in _EXPERT_KEYS if isinstance(getattr(text, k, None), int)), 0)
    if experts:
        top_k = int(getattr(text, "num_experts_per_tok", 1) or 1)
        expert_hidden = int(getattr(text, "moe_intermediate_size", None) or ffn)
        shared = int(getattr(text, "n_shared_experts", None) or 0)
        shared_size = getattr(text, "shared_expert_intermediate_size", None)
        if shared_size:
            if shared_size % expert_hidden:
                notes.append(f"shared expert width {shared_size} planned as {shared_size // expert_hidden} experts "
                             f"of {expert_hidden}")
            shared = max(1, int(shared_size) // expert_hidden)
            notes.append("the shared expert's sigmoid gate (hidden_size parameters per layer) is not modelled")
        step = int(getattr(text, "decoder_sparse_step", None) or getattr(text, "moe_layer_freq", None) or 1)
        first = int(getattr(text, "first_k_dense_replace", None) or 0) + (step - 1)
        mlp_only = sorted(int(i) for i in (getattr(text, "mlp_only_layers", None) or []))
        if mlp_only and mlp_only == list(range(len(mlp_only))) and step == 1:
            first = max(first, len(mlp_only))
        elif mlp_only:
            notes.append(f"mlp_only_layers={mlp_only} is not a prefix: planned as MoE layers")
        kw.update(num_experts=experts, top_k=top_k, expert_hidden=expert_hidden, shared_experts=shared,
                  moe_every=step, first_dense_layers=first)
    return kw, notes


def hf_spec(model: HFModelConfig) -> Optional[TransformerSpec]:
    """The planner's :class:`~lightning_4d.planner.TransformerSpec` of ``model``'s config (heads, head width,
    biases, q/k norms, MoE layers, shared experts, tied embeddings, positions: see :func:`hf_spec_notes` for what
    is approximated), or ``None`` when the config does not describe a decoder-only transformer block.

    Example:
        >>> # not run: needs files (a model directory or config file)
        >>> hf_spec(HFModelConfig(path="my-llama")).layers  # doctest: +SKIP
        32
    """
    from lightning_4d.planner import TransformerSpec

    cfg = hf_config(model)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    try:
        kw, _ = _spec_fields(text)
        return TransformerSpec(name=model.name, **kw)
    except (AttributeError, TypeError, ValueError):
        return None


def hf_spec_notes(model: HFModelConfig) -> list[str]:
    """What :func:`hf_spec` approximates for ``model``'s config (empty when the spec is exact by construction).

    Example:
        >>> # not run: needs files (a model directory or config file)
        >>> hf_spec_notes(HFModelConfig(config="my-deepseek-v3/config.json"))  # doctest: +SKIP
        ['multi-head latent attention is planned as full-width heads (its low-rank projections are not modelled)']
    """
    cfg = hf_config(model)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    try:
        return _spec_fields(text)[1]
    except (AttributeError, TypeError, ValueError) as err:
        return [f"{type(err).__name__}: {err}"]


def hf_config_with_layers(model: HFModelConfig, layers: int, directory: Path) -> HFModelConfig:
    """``model`` as a randomly initialised config of ``layers`` blocks, written to ``directory`` (same widths;
    MoE models keep a dense prefix when they have one): what the planner's dry run traces.

    Example:
        >>> # not run: needs files (a model directory or config file)
        >>> hf_config_with_layers(HFModelConfig(path="my-llama"), 4, tmp_path).config  # doctest: +SKIP
        '/tmp/.../config.json'
    """
    import dataclasses

    cfg = hf_config(model)
    cut = cfg.__class__.from_dict(cfg.to_dict())
    text = getattr(cut, "get_text_config", lambda: cut)()
    old = int(text.num_hidden_layers)
    text.num_hidden_layers = layers
    if getattr(text, "first_k_dense_replace", None):
        text.first_k_dense_replace = 0 if layers == 1 else min(text.first_k_dense_replace, layers // 2)
    if getattr(text, "mlp_only_layers", None):
        text.mlp_only_layers = [i for i in text.mlp_only_layers if i < layers]
    if getattr(text, "layer_types", None) and len(text.layer_types) == old:
        text.layer_types = list(text.layer_types)[:layers]
    directory.mkdir(parents=True, exist_ok=True)
    cut.to_json_file(str(directory / "config.json"))
    return dataclasses.replace(model, path=None, config=str(directory / "config.json"))


def build_hf(model: HFModelConfig) -> HFLogits:
    """:class:`~lightning_4d.models.HFLogits` of ``model.path`` (pretrained) or ``model.config`` (random init).

    Called on the meta device (:func:`~lightning_4d.recipes.build.build_model` does so under ``FourDStrategy``
    for a directory with safetensors), a pretrained model is built from its config with its weights attached
    (:meth:`~lightning_4d.models.HFLogits.from_pretrained`, ``meta``): the strategy reads each rank's slices
    straight from the files; elsewhere the whole model is loaded.

    Example:
        >>> # not run: needs files (a model directory or config file)
        >>> type(build_hf(HFModelConfig(config="my-llama/config.json"))).__name__  # doctest: +SKIP
        'HFLogits'
    """
    from lightning_4d.models.hf import HFLogits

    hf_config(model)  # clear errors for a missing path / config.json / weights
    options = dict(dtype=model.dtype, attn_implementation=model.attn_implementation,
                   trust_remote_code=model.trust_remote_code)
    load = HFLogits.from_pretrained if model.path is not None else HFLogits.from_config
    return load(Path(model.source).absolute(), **options)


def hf_param_count(model: HFModelConfig) -> ParamCount:
    """Exact parameters of ``model`` (a :class:`~lightning_4d.recipes.counts.ParamCount`) from a build
    on the meta device (no memory); tied weights count once, routed experts (``…experts…`` parameters) as
    ``expert`` and ``top_k / num_experts`` of them as active.

    Example:
        >>> # not run: needs files (a model directory or config file)
        >>> hf_param_count(HFModelConfig(path="my-llama")).expert  # doctest: +SKIP
        0
    """
    import torch
    from transformers import AutoModelForCausalLM

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
