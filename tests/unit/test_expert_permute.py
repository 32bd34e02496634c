"""Pure tests of token permutation (lightning_4d.expert_parallel.permute)."""

from __future__ import annotations

import pytest
import torch

from lightning_4d.expert_parallel.permute import (
    compute_capacity, inverse_permutation, make_permutation, permute, regroup_by_expert, split_sizes, unpermute,
)


def _random_routing(n: int, k: int, e: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, e, generator=g)
    top = scores.topk(k, dim=-1)
    return top.indices, top.values


@pytest.mark.parametrize("n,k,e", [(1, 1, 1), (7, 2, 4), (16, 3, 8), (5, 4, 4)])
def test_dropless_order_and_counts(n: int, k: int, e: int) -> None:
    idx, _ = _random_routing(n, k, e)
    plan = make_permutation(idx, e)
    flat = idx.reshape(-1)
    experts = flat[plan.slot_index]
    assert torch.all(experts[1:] >= experts[:-1])  # expert-major
    assert torch.equal(plan.tokens_per_expert, torch.bincount(flat, minlength=e))
    assert plan.slot_index.numel() == n * k and int(plan.num_dropped) == 0
    assert torch.equal(torch.sort(plan.slot_index).values, torch.arange(n * k))  # a permutation
    for ex in range(e):  # token order inside an expert
        toks = plan.token_index[experts == ex]
        assert torch.all(toks[1:] > toks[:-1])


def test_round_trip_identity_experts() -> None:
    idx, w = _random_routing(9, 2, 4)
    x = torch.randn(9, 6)
    plan = make_permutation(idx, 4)
    xs = permute(x, plan)
    assert torch.equal(xs, x[plan.token_index])
    out = unpermute(xs, plan, w)  # identity experts: sum_j w_j * x
    torch.testing.assert_close(out, x * w.sum(-1, keepdim=True))


def test_round_trip_matches_dense_loop() -> None:
    idx, w = _random_routing(11, 2, 5, seed=3)
    x = torch.randn(11, 4)
    mats = torch.randn(5, 4, 4)
    plan = make_permutation(idx, 5)
    xs = permute(x, plan)
    experts = idx.reshape(-1)[plan.slot_index]
    ys = torch.einsum("mh,moh->mo", xs, mats[experts])
    ref = torch.zeros(11, 4)
    for t in range(11):
        for j in range(2):
            ref[t] += w[t, j] * (mats[idx[t, j]] @ x[t])
    torch.testing.assert_close(unpermute(ys, plan, w), ref)


def test_capacity_drops_lowest_scores_deterministically() -> None:
    idx = torch.tensor([[0], [0], [0], [0], [1]])
    sc = torch.tensor([[0.5], [0.9], [0.5], [0.1], [0.3]])
    plan = make_permutation(idx, 2, scores=sc, capacity=2)
    # expert 0 keeps 0.9 (token 1) and the first of the tied 0.5s (token 0); drops token 2 and token 3
    assert plan.token_index.tolist() == [0, 1, 4]
    assert int(plan.num_dropped) == 2
    assert plan.tokens_per_expert.tolist() == [2, 1] and plan.routed_per_expert.tolist() == [4, 1]
    out = unpermute(torch.ones(3, 1), plan, torch.ones(5, 1))
    assert out.flatten().tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]  # dropped tokens get zero


def test_capacity_large_equals_dropless() -> None:
    idx, w = _random_routing(13, 2, 4, seed=1)
    a = make_permutation(idx, 4)
    b = make_permutation(idx, 4, scores=w, capacity=13 * 2)
    assert torch.equal(a.slot_index, b.slot_index) and int(b.num_dropped) == 0


def test_capacity_top2_mixed() -> None:
    idx, w = _random_routing(20, 2, 4, seed=5)
    cap = compute_capacity(40, 4, 1.0)
    plan = make_permutation(idx, 4, scores=w, capacity=cap)
    assert int(plan.tokens_per_expert.max()) <= cap
    assert int(plan.num_dropped) == int((plan.routed_per_expert - cap).clamp(min=0).sum())
    flat_e, flat_s = idx.reshape(-1), w.reshape(-1)
    kept = torch.zeros(40, dtype=torch.bool)
    kept[plan.slot_index] = True
    for e in range(4):  # every kept score of an expert >= every dropped score of it
        mine = flat_e == e
        if (mine & ~kept).any():
            assert flat_s[mine & kept].min() >= flat_s[mine & ~kept].max()


def test_compute_capacity_and_errors() -> None:
    assert compute_capacity(10, 4, 1.0) == 3
    assert compute_capacity(10, 4, 1.25) == 4
    with pytest.raises(ValueError, match="capacity_factor=0"):
        compute_capacity(10, 4, 0)
    with pytest.raises(ValueError, match="scores"):
        make_permutation(torch.zeros(2, 1, dtype=torch.long), 2, capacity=1)


def test_split_sizes() -> None:
    assert split_sizes(torch.tensor([1, 2, 3, 4, 5, 6]), 3).tolist() == [3, 7, 11]
    with pytest.raises(ValueError, match="not divisible by ep=4"):
        split_sizes(torch.arange(6), 4)


@pytest.mark.parametrize("seed", range(4))
def test_regroup_by_expert_matches_loop(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (3, 2), generator=g)  # (sources, local experts)
    rows, start = {}, 0
    for s in range(3):
        for j in range(2):
            rows[(s, j)] = list(range(start, start + int(counts[s, j])))
            start += int(counts[s, j])
    ref = [r for j in range(2) for s in range(3) for r in rows[(s, j)]]
    perm = regroup_by_expert(counts)
    assert perm.tolist() == ref
    x = torch.randn(int(counts.sum()), 2)
    assert torch.equal(x[perm][inverse_permutation(perm)], x)
