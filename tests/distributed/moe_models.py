"""Tiny MoE models for the parity tests: the package's MoE transformer and a Mixtral-style user model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.models import Llama, LlamaConfig
from lightning_4d.models.moe import MoEConfig, MoETransformer

VOCAB, SEQ = 64, 16


def build_moe_model(aux: float = 0.0, bias_rate: float = 0.0, top_k: int = 2) -> nn.Module:
    """The package's MoE transformer: 2 layers, 4 experts, top-``top_k`` (2), one shared expert."""
    return MoETransformer(MoEConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=SEQ,
                                    num_experts=4, top_k=top_k, expert_hidden=32, shared_experts=1,
                                    aux_loss_coef=aux, bias_update_rate=bias_rate))


class MixtralExpert(nn.Module):
    """One SwiGLU expert with Mixtral names."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    """A user's Mixtral block: softmax over all experts → top-k → renormalise → weighted sum."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(MixtralExpert(dim, hidden) for _ in range(num_experts))

    def reset_parameters(self) -> None:
        """Called by the Llama block's own reset (so the model can also be built on the meta device)."""
        for lin in [self.gate] + [w for e in self.experts for w in (e.w1, e.w2, e.w3)]:
            lin.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(-1, h)  # (N, H)
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float)  # (N, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view(b, t, h)


def build_mixtral_model() -> nn.Module:
    """A Llama whose feed-forwards are Mixtral-style sparse blocks (written by the "user")."""
    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64,
                              max_seq_len=SEQ))
    for block in model.layers:
        block.feed_forward = MixtralSparseMoeBlock(32, 32, num_experts=4, top_k=2)
    return model
