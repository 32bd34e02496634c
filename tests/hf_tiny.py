"""Tiny random Hugging Face configs shared by the streamed-load and fine-tuning tests (transformers' own config
classes; nothing downloaded)."""

from __future__ import annotations

from typing import Any


def tiny_config(kind: str, vocab_size: int) -> Any:
    """A 2-layer, hidden-32 config of ``kind``: ``llama`` (untied head), ``qwen3-tied``, ``qwen3moe`` or ``mixtral``.

    Example:
        >>> tiny_config("llama", 64).num_hidden_layers
        2
    """
    import transformers as tf

    dense = {"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    if kind == "llama":
        return tf.LlamaConfig(**dense, tie_word_embeddings=False)
    if kind == "qwen3-tied":
        return tf.Qwen3Config(**dense, head_dim=8, tie_word_embeddings=True)
    if kind == "qwen3moe":
        return tf.Qwen3MoeConfig(**dense, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True)
    if kind == "mixtral":
        return tf.MixtralConfig(**dense, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(kind)
