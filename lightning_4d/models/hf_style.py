"""A tiny decoder with Hugging Face module names, standing in for "a user model written with other
names" (``embed_tokens``, ``self_attn.q_proj``, ``mlp.gate_proj``, ``lm_head`` ...).

Same rules as :mod:`lightning_4d.models.llama`: no distributed code, head counts read from instance
attributes (``num_heads``, ``num_key_value_heads``, ``head_dim``) at forward time, a sequential
top-level forward, and ``to_empty`` + ``init_weights(seed)`` for meta-device materialisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.models.flops import training_flops_per_token
from lightning_4d.models.llama import (
    _config_error,
    _iter_blocks,
    apply_rope,
    packed_causal_mask,
    rope_at,
    rope_cos_sin,
    seeded,
)

__all__ = ["HFStyleAttention", "HFStyleConfig", "HFStyleDecoderLayer", "HFStyleLM", "HFStyleMLP"]


@dataclass(frozen=True)
class HFStyleConfig:
    """Hyper-parameters with Hugging Face names; ``num_key_value_heads=None`` means no GQA.
    ``attention_bias`` adds biases to ``q_proj k_proj v_proj`` (Qwen-style).

    >>> HFStyleConfig(vocab_size=64, hidden_size=32, num_attention_heads=4).num_key_value_heads
    4
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise _config_error(name, getattr(self, name), "must be >= 1", f"pass a positive {name}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.hidden_size % self.num_attention_heads:
            raise _config_error(
                "hidden_size", self.hidden_size,
                f"hidden_size must be divisible by num_attention_heads={self.num_attention_heads}",
                "choose hidden_size as a multiple of num_attention_heads")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise _config_error(
                "hidden_size", self.hidden_size, "head_dim = hidden_size // num_attention_heads must be even "
                "for RoPE", "pick hidden_size and num_attention_heads so that the head dim is even")
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise _config_error(
                "num_key_value_heads", self.num_key_value_heads,
                f"num_attention_heads={self.num_attention_heads} must be divisible by num_key_value_heads",
                "choose num_key_value_heads as a divisor of num_attention_heads")

    @property
    def head_dim(self) -> int:
        """Features per head, ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads


class HFStyleAttention(nn.Module):
    """Causal GQA attention with RoPE; ``q_proj k_proj v_proj`` in, ``o_proj`` out.

    >>> cfg = HFStyleConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    >>> HFStyleAttention(cfg)(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, config: HFStyleConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.initializer_range = config.initializer_range
        self.out_std = config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) in-projections, depth-scaled ``o_proj``, zero biases."""
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=self.initializer_range)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        nn.init.normal_(self.o_proj.weight, std=self.out_std)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``(B, T)`` of packed documents: rotary at those positions, attention within each
        document (:func:`~lightning_4d.models.llama.packed_causal_mask`); ``None``: positions ``0..T-1``."""
        B, T, _ = hidden_states.shape  # (B, T, D)
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(hidden_states).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        if position_ids is None:
            cos, sin = rope_cos_sin(T, self.head_dim, self.rope_theta, device=hidden_states.device)  # (T, hd)
        else:
            cos, sin = rope_at(position_ids, self.head_dim, self.rope_theta)  # (B, 1, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # k, v: (B, KV, T, hd)
        groups = self.num_heads // self.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
        if position_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        else:
            mask = packed_causal_mask(position_ids)  # (B, 1, T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, H*hd)
        return self.o_proj(y)  # (B, T, D)


class HFStyleMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    >>> HFStyleMLP(HFStyleConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_attention_heads=4))(torch.randn(1, 3, 32)).shape
    torch.Size([1, 3, 32])
    """

    def __init__(self, config: HFStyleConfig) -> None:
        super().__init__()
        self.initializer_range = config.initializer_range
        self.out_std = config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for gate/up, depth-scaled ``down_proj``."""
        nn.init.normal_(self.gate_proj.weight, std=self.initializer_range)
        nn.init.normal_(self.up_proj.weight, std=self.initializer_range)
        nn.init.normal_(self.down_proj.weight, std=self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))  # (B, T, I) -> (B, T, D)


class HFStyleDecoderLayer(nn.Module):
    """``x + self_attn(input_layernorm(x))`` then ``+ mlp(post_attention_layernorm(.))``.

    >>> cfg = HFStyleConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    >>> HFStyleDecoderLayer(cfg)(torch.randn(1, 3, 32)).shape
    torch.Size([1, 3, 32])
    """

    def __init__(self, config: HFStyleConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = HFStyleAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = HFStyleMLP(config)

    def reset_parameters(self) -> None:
        """Re-initialise both norms, the attention and the MLP."""
        for m in (self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp):
            m.reset_parameters()

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``(B, T)``: packed documents (see :meth:`HFStyleAttention.forward`)."""
        attn_in = self.input_layernorm(hidden_states)  # (B, T, D)
        a = self.self_attn(attn_in) if position_ids is None else self.self_attn(attn_in, position_ids=position_ids)
        h = hidden_states + a  # (B, T, D)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, D)


class HFStyleLM(nn.Module):
    """``embed_tokens -> layers -> norm -> lm_head`` returning logits ``(B, T, V)``; a part set to
    ``None`` (not owned by a pipeline stage) is skipped.

    >>> cfg = HFStyleConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                     num_attention_heads=4, num_key_value_heads=2)
    >>> with torch.device("meta"):
    ...     model = HFStyleLM(cfg)
    >>> model = model.to_empty(device="cpu")
    >>> model.init_weights(seed=0)
    >>> model(torch.randint(0, 64, (2, 8))).shape
    torch.Size([2, 8, 64])
    """

    def __init__(self, config: HFStyleConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HFStyleDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``embed_tokens.weight`` if ``config.tie_word_embeddings``."""
        if self.config.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, seed: int | None = None) -> None:
        """(Re-)initialise every parameter, optionally under ``torch.manual_seed(seed)`` (RNG restored)."""
        self.tie_weights()
        std = self.config.initializer_range
        with seeded(self, seed):
            if self.embed_tokens is not None:
                nn.init.normal_(self.embed_tokens.weight, std=std)
            for layer in _iter_blocks(self.layers):
                layer.reset_parameters()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.lm_head is not None and not self.config.tie_word_embeddings:
                nn.init.normal_(self.lm_head.weight, std=std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)``. ``position_ids`` ``(B, T)`` of packed documents (restarting at 0 where one starts):
        rotary positions and attention per document, so a packed row equals its documents run one by one."""
        h = input_ids  # (B, T) ids, or (B, T, D) hidden states on a later pipeline stage
        if self.embed_tokens is not None:
            if input_ids.shape[1] > self.config.max_position_embeddings:
                raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings="
                                 f"{self.config.max_position_embeddings}")
            h = self.embed_tokens(input_ids)  # (B, T, D)
        for layer in _iter_blocks(self.layers):
            h = layer(h) if position_ids is None else layer(h, position_ids=position_ids)  # (B, T, D)
        if self.norm is not None:
            h = self.norm(h)  # (B, T, D)
        if self.lm_head is not None:
            h = self.lm_head(h)  # (B, T, V)
        return h

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (tied once); ``exclude_embeddings`` drops ``embed_tokens`` unless tied."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.config.tie_word_embeddings and self.embed_tokens is not None:
            n -= self.embed_tokens.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """:func:`~lightning_4d.models.flops.training_flops_per_token` of ``num_params(exclude_embeddings=True)``."""
        c = self.config
        return training_flops_per_token(self.num_params(exclude_embeddings=True), c.num_hidden_layers,
                                        c.num_attention_heads * c.head_dim, seq_len)
