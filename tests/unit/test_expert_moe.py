"""Pure tests of the MoE layer, the expert math and the reference MoE transformer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_4d.expert_parallel import (
    MoE, expert_grad_scale, expert_load, grouped_linear, moe_aux_loss, scale_grad, swiglu_experts,
    update_expert_bias,
)
from lightning_4d.expert_parallel.experts import init_experts_
from lightning_4d.expert_parallel.parallel import check_expert_parallel
from lightning_4d.mesh import ParallelDims
from lightning_4d.models.moe import MoEConfig, MoETransformer, is_moe_layer


def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token reference of the MoE math."""
    h = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(moe.router.gate(h), -1, dtype=torch.float)
    w, idx = probs.topk(moe.top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    rows = []
    for t in range(h.shape[0]):
        acc = torch.zeros(h.shape[1])
        for j in range(moe.top_k):
            e = int(idx[t, j])
            ex = moe.experts
            acc = acc + w[t, j] * (ex.w2[e] @ (F.silu(ex.w1[e] @ h[t]) * (ex.w3[e] @ h[t])))
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(h)
    return out.reshape(x.shape)


@pytest.mark.parametrize("shared", [None, 16])
@pytest.mark.parametrize("grouped", [True, False])
def test_moe_matches_naive_outputs_and_grads(shared, grouped) -> None:
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2, shared_hidden_dim=shared, grouped_mm=grouped, init_std=0.3, out_init_std=0.3)
    x = torch.randn(2, 5, 8)
    g = torch.randn(2, 5, 8)
    moe(x).backward(g)
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    moe.zero_grad()
    ref = _naive(moe, x)
    ref.backward(g)
    torch.testing.assert_close(moe(x), ref, rtol=1e-5, atol=1e-6)
    for n, p in moe.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_grouped_linear_paths_agree_with_empty_groups() -> None:
    x = torch.randn(7, 8, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    counts = torch.tensor([3, 0, 4])
    a = grouped_linear(x, w, counts, True)
    b = grouped_linear(x, w, counts, False)
    torch.testing.assert_close(a, b)
    ga = torch.autograd.grad(a.sum(), (x, w))  # .sum() gives a non-contiguous gradient
    gb = torch.autograd.grad(b.sum(), (x, w))
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v)
    # unaligned sizes fall back to the loop under "auto"
    y = swiglu_experts(torch.randn(3, 5), torch.randn(1, 7, 5), torch.randn(1, 5, 7), torch.randn(1, 7, 5),
                       torch.tensor([3]))
    assert y.shape == (3, 5)


def test_capacity_and_monitoring() -> None:
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 1, capacity_factor=0.5)
    x = torch.randn(1, 16, 8)
    out = moe(x)
    assert int(moe.tokens_per_expert.sum()) == 16
    assert int(moe.dropped_tokens) == int((moe.tokens_per_expert - 2).clamp(min=0).sum())
    assert int(moe.dropped_tokens) > 0
    dropless = MoE(8, 16, 4, 1)
    dropless.load_state_dict(moe.state_dict())
    ref = dropless(x)
    zero_rows = (out.reshape(16, 8).abs().sum(-1) == 0).sum()
    assert int(zero_rows) == int(moe.dropped_tokens)
    kept = out.reshape(16, 8).abs().sum(-1) > 0
    torch.testing.assert_close(out.reshape(16, 8)[kept], ref.reshape(16, 8)[kept])
    assert torch.equal(expert_load(moe)[""], moe.tokens_per_expert)


def test_scale_grad() -> None:
    w = torch.ones(3, requires_grad=True)
    (scale_grad(w, 0.25) * 2).sum().backward()
    assert w.grad.tolist() == [0.5, 0.5, 0.5]
    assert scale_grad(w, 1.0) is w


def test_expert_init_is_layout_independent() -> None:
    full = torch.empty(8, 3, 4)
    init_experts_(full, 1.0, seed=11, first_expert=0)
    parts = [torch.empty(2, 3, 4) for _ in range(4)]
    for r, p in enumerate(parts):
        init_experts_(p, 1.0, seed=11, first_expert=2 * r)
    assert torch.equal(full, torch.cat(parts))


def test_expert_grad_scale_rule() -> None:
    assert expert_grad_scale(ParallelDims.from_world(4, ep=4)) == 0.25
    assert expert_grad_scale(ParallelDims.from_world(4, tp=2, ep=2)) == 1.0
    assert expert_grad_scale(ParallelDims.from_world(8, tp=2, ep=4)) == 0.5
    assert expert_grad_scale(ParallelDims.from_world(4, tp=2)) == 2.0
    # Without SP the tp ranks route the same tokens: no factor tp (the one rule the strategy applies).
    assert expert_grad_scale(ParallelDims.from_world(4, tp=2, sequence_parallel=False)) == 1.0
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep=4"):
        check_expert_parallel(6, 2, 4)
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        check_expert_parallel(4, 5, 1, "blk")
    with pytest.raises(ValueError, match="top_k=9 exceeds"):
        MoE(8, 16, 4, 9)


def test_helpers_aux_and_bias() -> None:
    moe = MoE(8, 16, 4, 2, aux_loss_coef=0.01, bias_update_rate=0.1)
    assert moe_aux_loss(moe) is None
    moe(torch.randn(5, 8))
    assert moe_aux_loss(moe) is not None
    update_expert_bias(moe)
    assert moe.router.expert_bias.abs().sum() > 0


def test_moe_transformer_layout_and_init() -> None:
    assert [is_moe_layer(i, 2, 3) for i in range(7)] == [False, False, True, False, False, True, False]
    cfg = MoEConfig(vocab_size=32, dim=16, n_layers=4, n_heads=2, ffn_hidden=32, num_experts=4, top_k=2,
                    expert_hidden=16, moe_every=2, first_dense_layers=1, shared_experts=1, aux_loss_coef=0.01)
    a, b = MoETransformer(cfg), MoETransformer(cfg)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert [isinstance(blk.feed_forward, MoE) for blk in a.layers] == [False, True, False, True]
    tokens = torch.randint(0, 32, (2, 6))
    logits = a(tokens)
    assert logits.shape == (2, 6, 32)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None for p in a.parameters())
    assert a.num_active_params() < a.num_params()
    assert len(a.moe_layers()) == 2
