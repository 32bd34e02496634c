"""Tiny models for the context-parallel tests: a user's own model calling ``F.scaled_dot_product_attention`` with
rotary positions from ``position_ids``, and transformers models through the package's ``HFLogits`` (which passes
``position_ids``) — Llama, Qwen3, Gemma 3 with alternating sliding-window / global layers and Mistral with a
window on every layer (windows of 4 tokens, shorter than the 16-token sequence and than a cp=2 rank's 8); plus
models context parallelism must refuse (eager attention; Gemma 2's attention logit soft-capping)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.byom_models import FFN, HEADS, HIDDEN, KV_HEADS, SEQ, VOCAB

KINDS = ("cp-user", "cp-hf-llama", "cp-hf-qwen3", "cp-hf-gemma3-window", "cp-hf-mistral-window",
         "cp-hf-llama-eager", "cp-hf-gemma2-softcap")
WINDOW = 4  # sliding window (tokens) of the windowed models


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
    else:
        raise ValueError(f"unknown context-parallel test model {kind!r}; known: {', '.join(KINDS)}")
    return HFLogits(model.float())
