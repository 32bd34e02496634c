"""Plain-torch GPT-2 with nanoGPT module names (``c_attn c_proj c_fc``), built from ``nn.Linear``.

Fused-QKV layout. ``c_attn`` maps ``n_embd -> 3 * n_embd`` and its output features are laid out
*per head, interleaved*: ``[h0: q k v | h1: q k v | ...]`` (each piece ``head_dim`` wide), and the
attention splits it with ``.view(B, T, self.n_head, 3, head_dim)``. A contiguous column shard of
``c_attn`` therefore holds whole heads with their own q, k and v, so tensor parallelism can shard
``c_attn`` column-wise, ``c_proj`` row-wise and set ``n_head`` to the per-rank count. Checkpoints that
use the blocked ``[q | k | v]`` layout (Hugging Face / OpenAI GPT-2) must go through
:func:`interleave_qkv` first (and the ``Conv1D`` weights of those checkpoints be transposed).

Initialisation contract as in :mod:`lightning_4d.models.llama`: ``to_empty`` then ``init_weights``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.models.flops import training_flops_per_token
from lightning_4d.models.llama import _config_error, _iter_blocks, packed_causal_mask, seeded

__all__ = ["GPT2", "GPT2Config", "GPT2Embeddings", "Block", "CausalSelfAttention", "MLP", "interleave_qkv"]


@dataclass(frozen=True)
class GPT2Config:
    """Hyper-parameters of :class:`GPT2` (defaults: GPT-2 small, 124M).

    >>> GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16).n_embd // 4
    8
    """

    vocab_size: int = 50304
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "block_size"):
            if getattr(self, name) < 1:
                raise _config_error(name, getattr(self, name), "must be >= 1", f"pass a positive {name}")
        if self.n_embd % self.n_head:
            raise _config_error(
                "n_embd", self.n_embd, f"n_embd must be divisible by n_head={self.n_head}",
                "choose n_embd as a multiple of n_head (or n_head a divisor of n_embd)")
        if not 0.0 <= self.dropout < 1.0:
            raise _config_error("dropout", self.dropout, "must be in [0, 1)", "use e.g. dropout=0.0 or 0.1")


def interleave_qkv(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Convert a blocked ``[q | k | v]`` fused weight ``(3C, C)`` or bias ``(3C,)`` to the per-head
    interleaved layout ``[h0: q k v | h1: q k v | ...]`` used by :class:`CausalSelfAttention`.

    >>> interleave_qkv(torch.arange(12.0), n_head=2).tolist()
    [0.0, 1.0, 4.0, 5.0, 8.0, 9.0, 2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    """
    three_c = t.shape[0]
    hd = three_c // (3 * n_head)
    return t.reshape(3, n_head, hd, *t.shape[1:]).transpose(0, 1).reshape(three_c, *t.shape[1:])


class GPT2Embeddings(nn.Module):
    """``drop(wte(tokens) + wpe(positions))`` — token plus learned absolute position embeddings.

    >>> GPT2Embeddings(vocab_size=64, n_embd=32, block_size=16)(torch.randint(0, 64, (2, 5))).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, vocab_size: int, n_embd: int, block_size: int, dropout: float = 0.0,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.block_size = block_size
        self.init_std = init_std
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for both tables."""
        nn.init.normal_(self.wte.weight, std=self.init_std)
        nn.init.normal_(self.wpe.weight, std=self.init_std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``(B, T)`` (packed documents): the learned positions at those indices, else ``0..T-1``."""
        T = tokens.shape[1]  # tokens: (B, T)
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        pos = torch.arange(T, device=tokens.device) if position_ids is None else position_ids  # (T,) or (B, T)
        return self.drop(self.wte(tokens) + self.wpe(pos))  # (B, T, C) + (T, C) or (B, T, C) -> (B, T, C)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with a fused, per-head-interleaved ``c_attn`` and an output ``c_proj``.

    ``forward`` reads ``self.n_head`` and ``self.head_dim`` at call time (``n_embd`` is informational);
    see the module docstring for the ``c_attn`` layout that makes a column shard hold whole heads.

    >>> CausalSelfAttention(n_embd=32, n_head=4)(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True,
                 init_std: float = 0.02, out_init_std: float = 0.02) -> None:
        super().__init__()
        self.n_head = n_head
        self.n_embd = n_embd
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.init_std = init_std
        self.out_init_std = out_init_std
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for ``c_attn``, Normal(0, out_init_std) for ``c_proj``, zero biases."""
        nn.init.normal_(self.c_attn.weight, std=self.init_std)
        nn.init.normal_(self.c_proj.weight, std=self.out_init_std)
        for lin in (self.c_attn, self.c_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``(B, T)`` of packed documents: attention within each document
        (:func:`~lightning_4d.models.llama.packed_causal_mask`)."""
        B, T, _ = x.shape  # (B, T, C)
        qkv = self.c_attn(x).view(B, T, self.n_head, 3, self.head_dim)  # (B, T, H, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # 3 x (B, H, T, hd)
        p = self.dropout if self.training else 0.0
        if position_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, hd)
        else:
            mask = packed_causal_mask(position_ids)  # (B, 1, T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, H*hd)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """``dropout(c_proj(gelu_tanh(c_fc(x))))`` with a 4x hidden width.

    >>> MLP(n_embd=32)(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, n_embd: int, dropout: float = 0.0, bias: bool = True,
                 init_std: float = 0.02, out_init_std: float = 0.02) -> None:
        super().__init__()
        self.init_std = init_std
        self.out_init_std = out_init_std
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for ``c_fc``, Normal(0, out_init_std) for ``c_proj``, zero biases."""
        nn.init.normal_(self.c_fc.weight, std=self.init_std)
        nn.init.normal_(self.c_proj.weight, std=self.out_init_std)
        for lin in (self.c_fc, self.c_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm block: ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``.

    >>> Block(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16))(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        out_std = config.init_std / math.sqrt(2 * config.n_layer)  # depth-scaled residual projections
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(
            config.n_embd, config.n_head, config.dropout, config.bias, config.init_std, out_std)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config.n_embd, config.dropout, config.bias, config.init_std, out_std)

    def reset_parameters(self) -> None:
        """Re-initialise both LayerNorms, the attention and the MLP."""
        for m in (self.ln_1, self.attn, self.ln_2, self.mlp):
            m.reset_parameters()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``(B, T)``: packed documents (see :meth:`CausalSelfAttention.forward`)."""
        h = self.ln_1(x)  # (B, T, C)
        x = x + (self.attn(h) if position_ids is None else self.attn(h, position_ids=position_ids))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT2(nn.Module):
    """GPT-2: ``embeddings -> h -> ln_f -> lm_head`` returning logits ``(B, T, V)``.

    ``lm_head.weight`` is ``embeddings.wte.weight`` when ``tie_embeddings``; ``init_weights`` re-ties
    (``to_empty`` breaks ties). Parts a pipeline stage does not own may be ``None`` (skipped).

    >>> cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, block_size=16)
    >>> with torch.device("meta"):
    ...     model = GPT2(cfg)
    >>> model = model.to_empty(device="cpu")
    >>> model.init_weights(seed=0)
    >>> model.lm_head.weight is model.embeddings.wte.weight
    True
    >>> model(torch.randint(0, 64, (2, 8))).shape
    torch.Size([2, 8, 64])
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = GPT2Embeddings(
            config.vocab_size, config.n_embd, config.block_size, config.dropout, config.init_std)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``embeddings.wte.weight`` if ``config.tie_embeddings``."""
        if self.config.tie_embeddings and self.embeddings is not None and self.lm_head is not None:
            self.lm_head.weight = self.embeddings.wte.weight

    def init_weights(self, seed: int | None = None) -> None:
        """(Re-)initialise every parameter, optionally under ``torch.manual_seed(seed)`` (RNG restored);
        re-ties ``lm_head`` to ``wte`` first."""
        self.tie_weights()
        with seeded(self, seed):
            if self.embeddings is not None:
                self.embeddings.reset_parameters()
            for block in _iter_blocks(self.h):
                block.reset_parameters()
            if self.ln_f is not None:
                self.ln_f.reset_parameters()
            if self.lm_head is not None and not self.config.tie_embeddings:
                nn.init.normal_(self.lm_head.weight, std=self.config.init_std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)``. ``position_ids`` ``(B, T)`` of packed documents (restarting at 0 where one
        starts): each token attends within its document only, with its position in the document."""
        x = tokens  # (B, T) token ids, or (B, T, C) hidden states on a later pipeline stage
        packed = position_ids is not None
        if self.embeddings is not None:
            x = self.embeddings(tokens, position_ids=position_ids) if packed else self.embeddings(tokens)  # (B, T, C)
        for block in _iter_blocks(self.h):
            x = block(x, position_ids=position_ids) if packed else block(x)  # (B, T, C)
        if self.ln_f is not None:
            x = self.ln_f(x)  # (B, T, C)
        if self.lm_head is not None:
            x = self.lm_head(x)  # (B, T, V)
        return x

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (tied weight once). ``exclude_embeddings`` drops ``wpe`` and, unless tied
        to ``lm_head``, ``wte``.

        >>> GPT2(GPT2Config(vocab_size=8, n_embd=4, n_layer=1, n_head=1, block_size=4)).num_params()
        300
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.embeddings is not None:
            n -= self.embeddings.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.embeddings.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: :func:`~lightning_4d.models.flops.training_flops_per_token` of
        ``num_params(exclude_embeddings=True)``, ``n_layer`` layers and ``n_embd`` attention width."""
        c = self.config
        return training_flops_per_token(self.num_params(exclude_embeddings=True), c.n_layer, c.n_embd, seq_len)
