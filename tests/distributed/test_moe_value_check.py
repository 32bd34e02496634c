"""The tensor-parallel value check covers mixture-of-experts models too (issue 32).

At set-up the rewritten model runs on the traced input and is compared with the unsharded output; that check once
ran only for models without an MoE layer, so a user's MoE model whose attention cannot follow a TP split trained on,
silently wrong (1.6e-3 away from one process's losses), while its dense twin was refused. The user model here is
Mixtral-style and written by hand: attention with ``wq wk wv wo`` and a ``gate`` + ``experts`` list per block. Its
broken variant reads the head count from a module constant (``q.view(B, T, N_HEADS, -1)``): after a TP split each
rank holds half the heads, so the view makes 4 heads of half width, which runs and is wrong.

Expected, in one world of 2 ranks (set-up plus one step, every rank):

- broken: refused at set-up under tp=2 (ep=1, with and without sequence parallelism) and tp=2 × ep=2, with the
  dense twin's message ("the tensor-parallel rewrite changes its output");
- correct (the same model with ``self.n_heads``, the package's MoE transformer, transformers' Qwen3-MoE and Mixtral
  built from their config classes): accepted under the same layouts, the check having replayed every MoE layer
  (the full-size check and the reduced copy's each log it).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.testing import run_world

os.environ.setdefault("OMP_NUM_THREADS", "1")

PG_TIMEOUT_S = 30  # a rank blocked on a failed peer gives up after this (legit waits here are ~1 s)
DIM, N_HEADS, VOCAB = 32, 4, 64
REFUSED = "the tensor-parallel rewrite changes its output"

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": dict(tp=2),
    "tp2-nosp": dict(tp=2, sequence_parallel=False),
    "tp2-ep2": dict(tp=2, ep=2),
}
# (model, layout, refused?)
CASES = [("dense-const", "tp2", True)] + [("user-moe-const", layout, True) for layout in LAYOUTS] + [
    ("user-moe", layout, False) for layout in LAYOUTS] + [
    ("moe", "tp2-ep2", False), ("hf-qwen3moe", "tp2", False), ("hf-mixtral", "tp2-ep2", False)]


# ----------------------------------------------------------------------------------------------- the user's model
class Attention(nn.Module):
    """Causal self-attention, head count from ``self.n_heads`` (the TP rewrite divides it by tp)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def heads(self) -> int:
        return self.n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, D)
        q, k, v = (w(x).view(b, t, self.heads(), -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, D/heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class ConstantHeadsAttention(Attention):
    """The bug: the head count from a module constant, which a TP split cannot change."""

    def heads(self) -> int:
        return N_HEADS


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Mixtral's block: softmax over the experts, top-2, renormalised, weighted sum."""

    def __init__(self, dim: int, hidden: int, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        weights, chosen = torch.topk(F.softmax(self.gate(flat), dim=-1), self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, moe: bool, constant_heads: bool) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = (ConstantHeadsAttention if constant_heads else Attention)(DIM, N_HEADS)
        self.feed_forward = SparseMoE(DIM, 32) if moe else SwiGLU(DIM, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class UserLM(nn.Module):
    def __init__(self, moe: bool = True, constant_heads: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(moe, constant_heads) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # (B, T, V)


def build(kind: str) -> nn.Module:
    from tests.distributed.common import build_model

    if kind.startswith(("user-moe", "dense")):
        return UserLM(moe=kind.startswith("user-moe"), constant_heads=kind.endswith("-const"))
    return build_model(kind)


# ----------------------------------------------------------------------------------------------- the world
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fit(kind: str, layout: str) -> dict[str, Any]:
    """One step on 2 ranks; the error message if set-up refuses, and what the check logged about MoE layers."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_4d import FourDStrategy
    from lightning_4d.models.lm import CausalLM
    from tests.distributed.common import make_dataset

    torch.manual_seed(0)
    lm = CausalLM(build(kind), lr=1e-4)
    strategy = FourDStrategy(**LAYOUTS[layout], timeout=timedelta(seconds=PG_TIMEOUT_S))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    records = _Records()
    logger = logging.getLogger("lightning_4d")
    logger.addHandler(records)
    level, logger.level = logger.level, logging.INFO
    try:
        trainer.fit(lm, DataLoader(make_dataset(4), batch_size=4))
        error = ""
    except ValueError as err:
        error = str(err)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return {"error": error, "replayed": [m for m in records.messages if "replayed" in m]}


def _world(rank: int) -> list[dict[str, Any]]:
    return [_fit(kind, layout) for kind, layout, _ in CASES]


def test_moe_models_get_the_tensor_parallel_value_check() -> None:
    per_rank = run_world(_world, 2, timeout_s=900, pg_timeout_s=PG_TIMEOUT_S)
    problems = []
    for rank, results in enumerate(per_rank):
        for (kind, layout, refused), got in zip(CASES, results):
            label = f"rank {rank}: {kind} under {layout}"
            if refused and REFUSED not in got["error"]:
                problems.append(f"{label}: not refused at set-up ({got['error'] or 'trained on'})")
            if not refused and got["error"]:
                problems.append(f"{label}: refused though correct: {got['error']}")
            if not refused and not got["replayed"]:
                problems.append(f"{label}: the value check did not run with its MoE layers replayed")
            if any("ran their own forward" in m for m in got["replayed"]):
                problems.append(f"{label}: an MoE layer was not replayed: {got['replayed']}")
    assert not problems, "\n".join(problems)
