"""Pure tests of the Mixtral-style block detection and rewrite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.expert_parallel import (
    MoE, convert_original_state_dict, export_original_state_dict, find_moe_modules, rewrite_moe_modules,
)


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int, hf: bool = False, act=F.silu) -> None:
        super().__init__()
        self.hf, self.act = hf, act
        if hf:
            self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
            self.down_proj = nn.Linear(hidden, dim, bias=False)
        else:
            self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        if self.hf:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    """Mixtral-style user block (Hugging Face's loop over experts)."""

    def __init__(self, dim=8, hidden=16, num_experts=4, top_k=2, hf=False, act=F.silu, return_logits=False):
        super().__init__()
        self.top_k, self.return_logits = top_k, return_logits
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden, hf, act) for _ in range(num_experts))

    def forward(self, hidden_states):
        b, t, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        router_logits = self.gate(x)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(x.dtype)
        final = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            idx, top_x = torch.where(mask[e])
            cur = expert(x[top_x]) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, cur.to(x.dtype))
        final = final.view(b, t, h)
        return (final, router_logits) if self.return_logits else final


class Net(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([SparseMoeBlock(**kw), SparseMoeBlock(**kw)])

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            out = blk(h)
            h = h + (out[0] if isinstance(out, tuple) else out)
        return h


def _mapped_grads(orig: nn.Module, new: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(original name, original grad, matching grad slice of the rewritten model)."""
    new_grads = {n: p.grad for n, p in new.named_parameters()}
    gsd = convert_original_state_dict(new, {n: p.grad for n, p in orig.named_parameters()})
    return [(n, gsd[n], new_grads[n]) for n in new_grads]


@pytest.mark.parametrize("hf", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_rewrite_equals_original(hf: bool, top_k: int) -> None:
    torch.manual_seed(0)
    orig = Net(hf=hf, top_k=top_k)
    new = rewrite_moe_modules(Net(hf=hf, top_k=top_k))
    new.load_state_dict(convert_original_state_dict(new, orig.state_dict()))
    assert all(isinstance(b, MoE) for b in new.blocks)
    x = torch.randn(3, 5, 8)
    y0, y1 = orig(x), new(x)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-7)
    g = torch.randn_like(y0)
    y0.backward(g)
    y1.backward(g)
    for name, a, b in _mapped_grads(orig, new):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_rewrite_copies_weights_and_keeps_names() -> None:
    torch.manual_seed(1)
    net = Net()
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    net = rewrite_moe_modules(net)
    moe = net.blocks[0]
    assert torch.equal(moe.experts.w1[2], sd["blocks.0.experts.2.w1.weight"])
    assert torch.equal(moe.experts.w2[3], sd["blocks.0.experts.3.w2.weight"])
    assert moe.source_key_map["experts.1.w3.weight"] == ("experts.w3", 1)
    assert moe.source_key_map["gate.weight"] == ("router.gate.weight", None)
    exported = export_original_state_dict(net)
    assert set(exported) == set(sd)
    for k in sd:
        assert torch.equal(exported[k], sd[k]), k
    assert moe.router.aux_loss_coef == 0 and moe.router.expert_bias is None


def test_rewrite_tuple_output_and_root_block() -> None:
    torch.manual_seed(2)
    blk = SparseMoeBlock(hf=True, return_logits=True)
    new = rewrite_moe_modules(SparseMoeBlock(hf=True, return_logits=True))
    new.load_state_dict(convert_original_state_dict(new, blk.state_dict()))
    assert isinstance(new, MoE) and new.return_router_logits
    x = torch.randn(2, 3, 8)
    (a, la), (b, lb) = blk(x), new(x)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(la, lb)


def test_find_moe_modules() -> None:
    net = Net()
    assert [n for n, _ in find_moe_modules(net)] == ["blocks.0", "blocks.1"]
    net = rewrite_moe_modules(net)
    assert [n for n, _ in find_moe_modules(net)] == ["blocks.0", "blocks.1"]
    assert find_moe_modules(nn.Linear(2, 2)) == []


def test_unsupported_blocks_raise_naming_the_module() -> None:
    with pytest.raises(ValueError, match=r"'blocks.0'.*forward does not compute Mixtral's math"):
        rewrite_moe_modules(Net(act=F.gelu))
    bad = Net()
    bad.blocks[1].gate = nn.Linear(8, 4, bias=True)
    with pytest.raises(ValueError, match=r"'blocks.1'.*bias-free"):
        rewrite_moe_modules(bad)
    bad = Net()
    del bad.blocks[0].top_k
    with pytest.raises(ValueError, match=r"'blocks.0'.*top_k"):
        rewrite_moe_modules(bad)
    bad = Net()
    bad.blocks[0].extra = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"'blocks.0'.*\['extra'\]"):
        rewrite_moe_modules(bad)


def test_rewrite_on_meta_skips_verification_and_keeps_rng() -> None:
    with torch.device("meta"):
        net = Net()
    state = torch.random.get_rng_state()
    net = rewrite_moe_modules(net)
    assert torch.equal(state, torch.random.get_rng_state())
    assert net.blocks[0].experts.w1.is_meta and net.blocks[0].experts.w1.shape == (4, 16, 8)


class _NeedsMask(SparseMoeBlock):
    def forward(self, hidden_states, mask):
        return super().forward(hidden_states) * mask


def test_block_that_cannot_be_called_is_reported_and_can_skip_verification() -> None:
    with pytest.raises(ValueError, match=r"'0'.*raised TypeError.*verify=False"):
        rewrite_moe_modules(nn.Sequential(_NeedsMask()))
    net = rewrite_moe_modules(nn.Sequential(_NeedsMask()), verify=False)
    assert isinstance(net[0], MoE)
