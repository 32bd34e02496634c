"""Tiny models for the context-parallel tests: a user's own model calling ``F.scaled_dot_product_attention`` with
rotary positions from ``position_ids``, and transformers models through the package's ``HFLogits`` (which passes
``position_ids``) — Llama, Qwen3, Gemma 3 with alternating sliding-window / global layers, Mistral with a window on
every layer, EXAONE 4 (a ``sliding_window`` attribute on every layer, applied only by its sliding ones) and its MoE
sibling, Llama 4 (chunked attention, chunks of 6, and a NoPE global layer); windows of 4 and chunks of 6 tokens,
shorter than the 16-token sequence and than a cp=2 rank's 8, and the chunks not aligned with the zigzag chunks; plus
models context parallelism must refuse (eager attention; Gemma 2's attention logit soft-capping; GPT-OSS and
MiMo-V2-Flash, eager-only with attention sinks; DeepSeek-V3.2's top-k indexer; Llama 4's attention temperature
tuning, positions from the local length)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.byom_models import FFN, HEADS, HIDDEN, KV_HEADS, SEQ, VOCAB

KINDS = ("cp-user", "cp-hf-llama", "cp-hf-qwen3", "cp-hf-gemma3-window", "cp-hf-mistral-window", "cp-hf-exaone4",
         "cp-hf-exaone-moe", "cp-hf-llama4", "cp-hf-llama-eager", "cp-hf-gemma2-softcap", "cp-hf-gpt-oss",
         "cp-hf-mimo-v2-flash", "cp-hf-deepseek-v32", "cp-hf-llama4-tuned")
WINDOW = 4  # sliding window (tokens) of the windowed models
CHUNK = 6  # Llama 4's attention chunk (tokens): crosses the zigzag chunks of 4 (cp=2) and 2 (cp=4)


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(B, H, T, hd)`` at ``positions`` ``(B, T)``."""
    hd = x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions.float()[:, None, :, None] * inv  # (B, 1, T, hd/2)
    cos, sin = angles.cos().repeat(1, 1, 1, 2), angles.sin().repeat(1, 1, 1, 2)  # (B, 1, T, hd)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class UserAttention(nn.Module):
    """A user's attention: q/k/v projections with biases, RoPE at the given positions, plain causal SDPA (no
    document mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, D)
        # (B, H, T, hd) each
        q, k, v = (lin(x).view(B, T, self.n_head, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        q, k = _rotate(q, positions), _rotate(k, positions)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class UserBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = UserAttention()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), positions)
        return x + self.mlp(self.norm2(x))


class UserLM(nn.Module):
    """The user's model: takes ``position_ids`` (``None``: ``0..T-1``) and uses them only for the rotary angles."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(UserBlock() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        x = self.embed(tokens)  # (B, T, D)
        for block in self.blocks:
            x = block(x, position_ids)
        return self.head(self.norm(x))  # (B, T, V)


def build_cp_model(kind: str) -> nn.Module:
    """One of :data:`KINDS` (transformers models built from their configs: nothing is downloaded)."""
    if kind == "cp-user":
        return UserLM()
    import transformers as tf

    from lightning_4d.models.hf import HFLogits

    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
                attention_dropout=0.0, use_cache=False)
    if kind in ("cp-hf-llama", "cp-hf-llama-eager"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**base, attn_implementation="eager" if "eager" in kind else "sdpa"))
    elif kind == "cp-hf-qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**base, head_dim=HIDDEN // HEADS, attn_implementation="sdpa"))
    elif kind == "cp-hf-gemma3-window":  # layer 0 local (window), layer 1 global, as Gemma 2 / 3 alternate
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **base, head_dim=HIDDEN // HEADS, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa"))
    elif kind == "cp-hf-mistral-window":
        model = tf.MistralForCausalLM(tf.MistralConfig(**base, sliding_window=WINDOW, attn_implementation="sdpa"))
    elif kind == "cp-hf-gemma2-softcap":  # transformers runs Gemma 2 eager only (SDPA has no logit soft-capping)
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**base, head_dim=HIDDEN // HEADS, sliding_window=WINDOW))
    elif kind == "cp-hf-exaone4":  # every attention module holds sliding_window; the full layer ignores it
        model = tf.Exaone4ForCausalLM(tf.Exaone4Config(
            **base, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
            attn_implementation="sdpa"))
    elif kind == "cp-hf-exaone-moe":
        model = tf.ExaoneMoeForCausalLM(tf.ExaoneMoeConfig(
            **base, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=FFN // 2, mlp_layer_types=["dense", "sparse"],
            attn_implementation="sdpa"))
    elif kind in ("cp-hf-llama4", "cp-hf-llama4-tuned"):  # a chunked RoPE layer, then a global NoPE layer
        # (temperature tuning: NoPE queries scaled by positions from torch.arange of the local length)
        model = tf.Llama4ForCausalLM(tf.Llama4TextConfig(
            **{**base, "intermediate_size_mlp": FFN}, head_dim=HIDDEN // HEADS, attention_chunk_size=CHUNK,
            layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
            attn_temperature_tuning=kind.endswith("tuned"), moe_layers=[], num_local_experts=1,
            attn_implementation="sdpa"))
    elif kind == "cp-hf-gpt-oss":  # eager only: attention sinks
        model = tf.GptOssForCausalLM(tf.GptOssConfig(
            **base, head_dim=HIDDEN // HEADS, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
            num_local_experts=4, num_experts_per_tok=2))
    elif kind == "cp-hf-mimo-v2-flash":  # eager only: attention sinks on its sliding layers
        model = tf.MiMoV2FlashForCausalLM(tf.MiMoV2FlashConfig(
            **base, head_dim=HIDDEN // HEADS, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "dense"]))
    elif kind == "cp-hf-deepseek-v32":  # MLA with the DSA indexer's top-k over the keys
        model = tf.DeepseekV32ForCausalLM(tf.DeepseekV32Config(
            **{**base, "num_key_value_heads": HEADS}, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, index_topk=WINDOW, index_head_dim=8, index_n_heads=2,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=FFN // 2,
            mlp_layer_types=["dense", "dense"], n_group=1, topk_group=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="sdpa"))
    else:
        raise ValueError(f"unknown context-parallel test model {kind!r}; known: {', '.join(KINDS)}")
    return HFLogits(model.float())
