"""Tiny models and data shared by the pipeline tests (module-level so forkserver ranks import them; no tests)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.models import CausalLM

VOCAB, DIM, SEQ, BATCH, LAYERS = 16, 8, 4, 8, 8


class Block(nn.Module):
    """Pre-norm residual MLP block ``x + fc2(gelu(fc1(norm(x))))``, shape-preserving ``(B, T, D)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding → blocks → norm → head; optionally ties head and embedding (GPT-2 style)."""

    def __init__(self, layers: int = LAYERS, tie: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)  # (B, T, D)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))  # (B, T, V)


class ScaledEmbedLM(TinyLM):
    """Forward is not a plain chain: the embedding output is scaled (needs a pre-blocks hook)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) * 2.0
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def build(seed: int = 0, tie: bool = False) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(tie=tie)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the valid (``!= -100``) tokens of a (micro-)batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def batch(step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets; the number of ignored targets differs per sample, rows 2-3 are all ignored."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    y = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    for row in range(size):
        y[row, : row % SEQ] = -100
    y[2:4] = -100
    return x, y


def replay_recorded(events: list[Any], step: int) -> tuple[float, dict[int, float], dict[int, float]]:
    """Each rank's compute actions of ``step``, in the order the instrument recorded them, replayed
    under the cost model (``F = I = W = 1``, ``B = 2``, zero-latency messages): the makespan and the
    idle share ``1 − busy / makespan`` per rank and per stage. Deterministic: wall time plays no part."""
    from lightning_4d.pipeline.bubble import Action, simulate_actions
    from lightning_4d.pipeline.instrument import COMPUTE_KINDS

    order: dict[int, list[Action]] = {}
    for e in sorted(events, key=lambda e: (e.rank, e.t0)):
        if e.step == step and e.kind in COMPUTE_KINDS:
            order.setdefault(e.rank, []).append(Action(e.stage, e.kind, e.microbatch))
    stages = {a.stage for acts in order.values() for a in acts}
    sim = simulate_actions(order, len(stages))
    busy = {s: sum(t1 - t0 for acts in sim.timeline.values() for a, t0, t1 in acts if a.stage == s) for s in stages}
    return sim.makespan, sim.bubble_by_rank(), {s: 1 - b / sim.makespan for s, b in sorted(busy.items())}


def assert_causal(events: list[Any], step: int) -> None:
    """The recorded intervals respect the pipeline's data dependencies on the shared monotonic clock:
    ``F(s, i)`` starts after ``F(s − 1, i)`` ends, ``B/I(s, i)`` after ``B/I(s + 1, i)``, ``W(s, i)`` after ``I(s, i)``."""
    end = {(e.stage, "B" if e.kind == "I" else e.kind, e.microbatch): e.t1 for e in events if e.step == step}
    for e in events:
        if e.step != step or e.kind not in ("F", "B", "I", "W"):
            continue
        before = {"F": (e.stage - 1, "F"), "B": (e.stage + 1, "B"), "I": (e.stage + 1, "B"), "W": (e.stage, "B")}
        dep = (*before[e.kind], e.microbatch)
        assert dep not in end or end[dep] <= e.t0, f"{e} started before {dep} ended ({end[dep]})"



def build_scaled_llama(vocab: int, seq: int) -> nn.Module:
    """A 4-layer package Llama whose forward scales the embedding: no plain chain, so with
    :class:`HookedCausalLM` the stages must run what its pipeline hooks say."""
    from lightning_4d.models import Llama, LlamaConfig

    class ScaledLlama(Llama):
        def forward(self, tokens: torch.Tensor, position_ids: Any = None) -> torch.Tensor:
            h = self.tok_embeddings(tokens) * 2.0  # (B, T, D)
            for layer in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
                h = layer(h)
            return self.output(self.norm(h))  # (B, T, V)

    return ScaledLlama(LlamaConfig(vocab_size=vocab, dim=32, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=64,
                                   max_seq_len=seq))


class HookedCausalLM(CausalLM):
    """A LightningModule implementing the package's pipeline hooks for :func:`build_scaled_llama` (a hook ignored
    or mis-wired shows as a set-up refusal or a loss difference)."""

    def pipeline_pre_blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(tokens) * 2.0  # (B, T) -> (B, T, D)

    def pipeline_post_blocks(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.output(self.model.norm(h))  # (B, T, D) -> (B, T, V)
