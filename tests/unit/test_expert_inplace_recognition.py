"""Recognising a model's own experts module by structure, and refusing loudly what does not fit.

An experts module holds ``[E, ...]`` parameters (at least one 3-D) next to a router holding an ``(E, H)``
weight, and its forward takes ``(hidden, top_k_index, top_k_weights)`` (transformers) or
``(x, num_tokens_per_expert)`` (TorchTitan). Before anything is sharded, the expert-parallel scheme is replayed
in one process (experts run in groups with local ids, the results summed back) and compared with the plain
forward, so a forward that is not a per-assignment sum fails at setup with the module's name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.expert_parallel.inplace import find_expert_modules, install_expert_parallel, verify_experts
from lightning_4d.expert_parallel.parallel import apply_inplace_expert_parallel

H, FF, E, K, N = 8, 12, 4, 2, 10


class Experts(nn.Module):
    """transformers-5 style: fused gate|up [E, 2F, H], down [E, H, F]; output = Σ_j w_j · expert_j(x)."""

    def __init__(self, scale_by_batch: bool = False) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * FF, H) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, H, FF) * 0.3)
        self.scale_by_batch = scale_by_batch

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)  # (N, H)
        for e in range(self.num_experts):
            tok, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_k_weights[tok, slot, None]
            out.index_add_(0, tok, y)
        if self.scale_by_batch:  # not a per-assignment sum: depends on every token of the call
            out = out / out.abs().mean()
        return out


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H))

    def forward(self, x: torch.Tensor):
        probs = F.linear(x, self.weight).softmax(-1)  # (N, E)
        w, idx = probs.topk(K, dim=-1)
        return w / w.sum(-1, keepdim=True), idx


class Block(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.gate, self.experts = Router(), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x)
        return self.experts(x, idx, w)


class TitanExperts(nn.Module):
    """TorchTitan style: x sorted by expert and the tokens per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, FF, H) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, H, FF) * 0.3)
        self.w3 = nn.Parameter(torch.randn(E, FF, H) * 0.3)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            outs.append(F.linear(F.silu(F.linear(chunk, self.w1[e])) * F.linear(chunk, self.w3[e]), self.w2[e]))
        return torch.cat(outs)


class TitanMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = TitanExperts()


class _Mesh:
    """Enough of a DeviceMesh for the checks that run before any sharding."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_transformers_and_torchtitan_layouts_are_recognised() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"hf": Block(Experts()), "titan": TitanMoE()})
    specs, rejected = find_expert_modules(model)
    assert rejected == []
    got = {s.name: (s.contract, s.num_experts, sorted(s.params), s.router) for s in specs}
    assert got == {"hf.experts": ("assignments", E, ["down_proj", "gate_up_proj"], "gate"),
                   "titan.experts": ("grouped", E, ["w1", "w2", "w3"], "router")}
    for spec in specs:  # the one-process replay of 2 and 4 ranks reproduces the plain forward
        for parts in (2, 4):
            verify_experts(model.get_submodule(spec.name), spec, parts=parts)


def test_installed_experts_compute_the_same_and_keep_their_names() -> None:
    torch.manual_seed(0)
    block = Block(Experts())
    x = torch.randn(N, H)
    ref = block(x)
    names = sorted(n for n, _ in block.named_parameters())
    (spec,), _ = find_expert_modules(block)
    install_expert_parallel(block.experts, spec)
    assert torch.equal(block(x), ref)
    assert sorted(n for n, _ in block.named_parameters()) == names
    assert isinstance(block.experts, Experts)  # the user's class, subclassed in place
    tokens = block.experts.fourd_tokens_per_expert
    assert tokens.shape == (E,) and int(tokens.sum()) == N * K


def test_unrecognised_moe_looking_modules_are_listed_with_the_reason() -> None:
    class NoRouter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()

    class OddForward(Experts):
        def forward(self, x, a, b, c):  # type: ignore[override]  # no contract takes four inputs
            return x

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(E, H, H))
            self.b = nn.Parameter(torch.zeros(E + 1, H))

    model = nn.ModuleDict({"a": NoRouter(), "b": Block(OddForward()), "c": Mixed()})
    specs, rejected = find_expert_modules(model)
    assert specs == []
    reasons = dict(rejected)
    assert "no sibling holds a router weight of shape (4, hidden)" in reasons["a.experts"]
    assert "forward takes neither" in reasons["b.experts"]
    assert "do not share one leading expert dimension" in reasons["c"]
    with pytest.raises(ValueError, match=r"ep=2: 3 module\(s\) of ModuleDict look like mixture-of-experts.*'a\.experts'"):
        apply_inplace_expert_parallel(model, _Mesh(2))  # type: ignore[arg-type]
    assert apply_inplace_expert_parallel(model, None) == []  # ep=1: nothing to shard, nothing refused


def test_a_forward_that_is_not_a_per_assignment_sum_fails_at_setup() -> None:
    torch.manual_seed(0)
    block = Block(Experts(scale_by_batch=True))
    (spec,), _ = find_expert_modules(block)
    with pytest.raises(ValueError, match=r"experts module 'experts' \(Experts\): running its experts in 2 groups"):
        verify_experts(block.experts, spec, parts=2)


def test_expert_count_must_divide_ep() -> None:
    block = Block(Experts())
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by ep=3"):
        apply_inplace_expert_parallel(block, _Mesh(3))  # type: ignore[arg-type]


def test_the_refusal_states_each_contract_including_every_token_experts() -> None:
    # What the in-place rewrite assumes about an every-token experts module (Llama 4) is part of the refusal, so a
    # user can tell whether their module fits: rows expert-major, scores applied before, each row on its own.
    class NoRouter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()

    with pytest.raises(ValueError, match=r"forward\(x\) of every-token experts.*\(E·N, hidden\) expert-major.*"
                                         r"scores already applied.*rows i·N to \(i\+1\)·N go through expert i's "
                                         r"weights alone, each row on its own"):
        apply_inplace_expert_parallel(nn.ModuleDict({"a": NoRouter()}), _Mesh(2))  # type: ignore[arg-type]


Z = 2  # zero (identity) experts beside the E routed ones


class ZeroExpertLayer(nn.Module):
    """LongCat-Flash's layout (transformers 5.25): the router scores ``E + Z`` experts; the layer adds
    ``x · weight`` for the zero-expert assignments itself and hands the experts a weight-0 id in ``[0, E)`` instead."""

    def __init__(self, evidence: bool = True, ids_beyond: bool = False) -> None:
        super().__init__()
        if evidence:
            self.num_routed_experts, self.zero_expert_num = E, Z
        self.ids_beyond = ids_beyond
        self.router, self.experts = nn.Linear(H, E + Z, bias=False), Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = F.linear(x, self.router.weight).softmax(-1).topk(K, dim=-1)  # (N, K)
        zero = idx >= E
        identity = x * w.masked_fill(~zero, 0.0).sum(-1, keepdim=True)  # (N, H)
        if not self.ids_beyond:
            idx, w = torch.where(zero, idx % E, idx), w.masked_fill(zero, 0.0)
        return self.experts(x, idx, w) + identity


def test_zero_experts_in_the_router_are_recognised_and_replayed() -> None:
    # The router holds E + Z rows and the experts E: recognised on the layer's evidence (its counts of routed and
    # zero experts), the experts module replayed in groups as any other; a larger linear without it is no router.
    torch.manual_seed(0)
    model = nn.ModuleDict({"longcat": ZeroExpertLayer(), "plain": ZeroExpertLayer(evidence=False)})
    specs, rejected = find_expert_modules(model)
    assert [(s.name, s.num_experts, s.router, s.zero_experts) for s in specs] == [("longcat.experts", E, "router", Z)]
    assert rejected == [("plain.experts", "no sibling holds a router weight of shape (4, hidden), nor a module around "
                                          "its parent")]
    verify_experts(model["longcat"].experts, specs[0], parts=2)
    x = torch.randn(N, H)
    assert bool((F.linear(x, model["longcat"].router.weight).topk(K).indices >= E).any())  # zero experts are hit
    ref = model["longcat"](x)
    install_expert_parallel(model["longcat"].experts, specs[0])
    assert torch.equal(model["longcat"](x), ref)


def test_an_id_beyond_the_experts_is_refused_under_ep() -> None:
    # A layer that passes zero-expert ids on to the experts module: no rank owns them, so the all-to-all would send
    # them nowhere; refused with the module's name at the first forward (the ep group is stood in for: the check
    # comes before any collective).
    torch.manual_seed(0)
    layer = ZeroExpertLayer(ids_beyond=True)
    (spec,), _ = find_expert_modules(layer)
    install_expert_parallel(layer.experts, spec)
    layer.experts.fourd_experts.group = object()  # type: ignore[assignment]
    x = torch.randn(4 * N, H)
    with pytest.raises(ValueError, match=r"experts module 'experts' \(Experts\) received expert id [45] but holds 4"):
        layer(x)


def test_expert_stacks_of_two_leading_sizes_are_refused_under_ep() -> None:
    # LongCat-Flash of earlier transformers 5 releases: gate_up_proj [E + Z, ...] beside down_proj [E, ...]. A
    # Shard(0) of E + Z rows cannot follow the owners of E experts: refused under ep naming the sizes and the fix;
    # at ep=1 it runs as written.
    class StackedZero(Experts):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(E + Z, 2 * FF, H) * 0.3)

    model = nn.ModuleDict({"layer": ZeroExpertLayer()})
    model["layer"].experts = StackedZero()
    specs, rejected = find_expert_modules(model)
    assert specs == [] and [n for n, _ in rejected] == ["layer.experts"]
    assert "two leading sizes (gate_up_proj: 6, down_proj: 4)" in rejected[0][1]
    with pytest.raises(ValueError, match=r"'layer\.experts': its expert stacks have two leading sizes.*cannot be "
                                         r"sharded exactly\. Fix: keep zero experts out of the stacks.*or use ep=1"):
        apply_inplace_expert_parallel(model, _Mesh(2))  # type: ignore[arg-type]
    assert apply_inplace_expert_parallel(model, None) == []
