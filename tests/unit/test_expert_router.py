"""Pure tests of the top-k router (aux loss, aux-loss-free bias)."""

from __future__ import annotations

import pytest
import torch

from lightning_4d.expert_parallel import MoE, TopKRouter, check_routing


def test_softmax_topk_renormalised_is_mixtral_math() -> None:
    torch.manual_seed(0)
    r = TopKRouter(8, 6, 2)
    x = torch.randn(10, 8)
    out = r(x)
    probs = torch.softmax(r.gate(x), dim=-1, dtype=torch.float)
    w, i = torch.topk(probs, 2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    assert torch.equal(out.indices, i) and torch.equal(out.weights, w)


def test_sigmoid_and_route_scale() -> None:
    torch.manual_seed(0)
    r = TopKRouter(8, 6, 3, score_func="sigmoid", route_scale=2.5)
    x = torch.randn(5, 8)
    out = r(x)
    s = torch.sigmoid(r.gate(x))
    w, i = torch.topk(s, 3, dim=-1)
    torch.testing.assert_close(out.weights, 2.5 * w / (w.sum(-1, keepdim=True) + 1e-20))
    assert torch.equal(out.indices, i)
    r2 = TopKRouter(8, 6, 1, renormalize=False)
    o2 = r2(x)
    torch.testing.assert_close(o2.weights, torch.softmax(r2.gate(x), -1).gather(-1, o2.indices))


def _aux_ref(scores: torch.Tensor, idx: torch.Tensor, e: int, k: int) -> torch.Tensor:
    n = scores.shape[0]
    f = torch.bincount(idx.reshape(-1), minlength=e).float() / (n * k)
    return e * (f * scores.mean(0)).sum()


def test_aux_loss_value_and_gradient_via_attachment() -> None:
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2, aux_loss_coef=0.1)
    ref = MoE(8, 16, 4, 2)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(3, 5, 8)
    tgt = torch.randn(3, 5, 8)
    ((moe(x) - tgt) ** 2).mean().backward()
    # reference: explicit loss + coef * aux
    y = ref(x)
    h = x.reshape(-1, 8)
    scores = torch.softmax(ref.router.gate(h), -1, dtype=torch.float)
    aux = _aux_ref(scores, scores.topk(2, -1).indices, 4, 2)
    (((y - tgt) ** 2).mean() + 0.1 * aux).backward()
    torch.testing.assert_close(moe.router.aux_loss, aux.detach())
    for (n, p), q in zip(moe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert moe.router.gate.weight.grad is not None


def test_aux_loss_balanced_is_one() -> None:
    r = TopKRouter(4, 4, 1, aux_loss_coef=1.0)
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(4) * 50)
    r(torch.eye(4) * 1.0)
    torch.testing.assert_close(r.aux_loss, torch.tensor(1.0), atol=1e-4, rtol=0)


def test_sigmoid_aux_loss_finite_and_eval_skips_it() -> None:
    r = TopKRouter(8, 4, 2, score_func="sigmoid", aux_loss_coef=0.01)
    out = r(torch.randn(6, 8))
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)
    assert r.eval()(torch.randn(6, 8)).aux_loss is None


def test_bias_changes_selection_not_weights() -> None:
    torch.manual_seed(0)
    r = TopKRouter(8, 4, 1, bias_update_rate=0.01)
    x = torch.randn(6, 8)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    out = r(x)
    assert torch.all(out.indices == 2)
    torch.testing.assert_close(out.weights, torch.ones(6, 1))  # renormalised top-1
    r.renormalize = False
    out = r(x)
    torch.testing.assert_close(out.weights, torch.softmax(r.gate(x), -1)[:, 2:3])  # score, not score+bias


def test_update_bias_sign_rule_and_accumulation() -> None:
    r = TopKRouter(4, 4, 1, bias_update_rate=0.5)
    with torch.no_grad():
        r.gate.weight.copy_(torch.eye(4) * 50)
    x = torch.eye(4)[[0, 0, 0, 1]]
    r(x)
    r(x)  # accumulates: load (6, 2, 0, 0), mean 2
    load = r.update_bias()
    assert load.tolist() == [6.0, 2.0, 0.0, 0.0]
    assert r.expert_bias.tolist() == [-0.5, 0.0, 0.5, 0.5]
    assert r.load_accum.sum() == 0
    r.eval()(x)
    assert r.load_accum.sum() == 0  # eval does not count


def test_expert_bias_is_checkpointed_only_when_used() -> None:
    assert "expert_bias" in TopKRouter(4, 4, 1, bias_update_rate=0.1).state_dict()
    assert set(TopKRouter(4, 4, 1).state_dict()) == {"gate.weight"}


@pytest.mark.parametrize("e,k,msg", [(2, 3, "top_k=3 exceeds num_experts=2"), (0, 1, "num_experts=0"),
                                     (4, 0, "top_k=0")])
def test_invalid_settings(e: int, k: int, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        check_routing(e, k)
    with pytest.raises(ValueError, match="score_func"):
        check_routing(4, 1, "relu")
