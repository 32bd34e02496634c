"""The host-sync counter (:class:`lightning_4d.testing.HostSyncCounter`) counts what a GPU would stall on — a value
read on the host, an output sized by values, host data copied to the device — and nothing else; and the step's
pieces that used to read counts on the host (loss weighting, MoE routing and dispatch bookkeeping, grouped experts,
clipping, the non-finite guard) read none now, with values unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.testing import HostSyncCounter


def _count(fn) -> HostSyncCounter:
    with HostSyncCounter() as syncs:
        fn()
    return syncs


@pytest.mark.parametrize("what, fn, kind", [
    ("item", lambda x: x.sum().item(), "item"),
    ("bool", lambda x: bool(x.sum() > 0), "item"),
    ("float", lambda x: float(x.sum()), "item"),
    ("int", lambda x: int(x.sum()), "item"),
    ("tolist", lambda x: x.tolist(), "tolist"),
    ("numpy", lambda x: x.numpy(), "tolist"),
    ("cpu", lambda x: x.cpu(), "to_host"),
    ("bincount", lambda x: torch.bincount(x.long().abs(), minlength=4), "bincount"),
    ("nonzero", lambda x: torch.where(x > 0), "nonzero"),
    ("mask read", lambda x: x[x > 0], "mask_index"),
    ("mask write of a tensor", lambda x: x.__setitem__(x > 0, torch.zeros_like(x)[x > 0]), "mask_index"),
    ("repeat_interleave", lambda x: torch.repeat_interleave(torch.tensor([1, 2])), "repeat_interleave"),
    ("host data to the device", lambda x: torch.tensor([1.0], device=x.device), "to_device"),
    ("equal", lambda x: torch.equal(x, x), "item"),
])
def test_each_kind_of_sync_is_counted(what: str, fn, kind: str) -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    syncs = _count(lambda: fn(x))
    assert syncs.count >= 1 and kind in syncs.kinds(), (what, syncs.report())
    assert all(" at tests/unit/test_host_syncs.py:" in site for site in syncs.sites), syncs.report()


def test_device_side_work_is_not_counted() -> None:
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)

    def step() -> None:
        counts = torch.zeros(3, dtype=torch.long).scatter_add_(0, torch.tensor([0, 2, 2]), torch.ones(3, dtype=torch.long))
        y = F.linear(x, w).softmax(-1)
        y = torch.where(y > 0.5, y, 0.0)  # three-argument where: no sync
        masked = x.clone()
        masked[x > 0] = 0.0  # one mask, a scalar value: the kernel runs masked_fill_
        idx = torch.repeat_interleave(torch.arange(3), counts, output_size=3)  # the size is given
        (y.sum() + masked.sum() + idx.sum()).backward()
        torch.tensor([1.0])  # a host tensor stays on the host
        torch.full((2,), 3.0)  # a fill, not a copy

    syncs = _count(step)
    assert syncs.count == 0, syncs.report()


def test_the_counter_catches_an_item_in_a_training_step() -> None:
    # A step that logs its loss with .item() makes exactly one sync, named where it was made; the same step logging
    # the tensor makes none.
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)

    def step(read: bool) -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if read:
            _ = loss.item()

    assert _count(lambda: step(False)).count == 0
    syncs = _count(lambda: step(True))
    assert syncs.count == 1 and list(syncs.sites) == [next(iter(syncs.sites))]
    assert next(iter(syncs.sites)).startswith("item at tests/unit/test_host_syncs.py:")


def test_host_tables_of_the_optimizer_are_ignored_by_default() -> None:
    # foreach=False AdamW reads its host-side step counters (host tensors on a GPU run too): ignored by call site.
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with HostSyncCounter() as syncs:
        opt.step()
    assert syncs.count == 0 and syncs.ignored > 0, syncs.report()
    with HostSyncCounter(ignore=()) as everything:
        opt.step()
    assert everything.count == syncs.ignored


def test_a_real_device_counts_only_its_tensors() -> None:
    # With device="cuda" the host tensors of a CPU run are host tensors: nothing counted; device=None/"cpu" stands in.
    x = torch.ones(3)
    with HostSyncCounter(device="cuda") as on_gpu:
        x.sum().item()
        x.tolist()
    with HostSyncCounter(device="cpu") as stand_in:
        x.sum().item()
    assert on_gpu.count == 0 and stand_in.count == 1


# ---------------------------------------------------------------------------------------------- the step's pieces
def test_loss_weighting_reads_nothing_on_the_host_and_keeps_its_values() -> None:
    from lightning_4d.core.loss import count_targets, token_weighted, weighted_global_loss

    local = torch.tensor(2.5, requires_grad=True)
    targets = torch.tensor([[1, -100, 3, 4]])
    with HostSyncCounter() as syncs:
        n = count_targets(targets)
        loss = weighted_global_loss(local, n, None, 1)
        empty = weighted_global_loss(torch.tensor(float("nan"), requires_grad=True), torch.tensor(0.0), None, 1)
        weighted = token_weighted(torch.tensor(2.0), torch.tensor(3.0), torch.tensor(12.0), scale=2.0)
        floats = count_targets(torch.zeros(2, 3))
    assert syncs.count == 0, syncs.report()
    loss.backward()
    assert float(loss.detach()) == 2.5 and float(local.grad) == 1.0
    assert float(empty.detach()) == 0.0 and float(weighted) == 1.0 and float(floats) == 6.0
    # the tensor factor rounds like the Python float it replaces
    mean = torch.tensor(0.7310585975646973)
    assert torch.equal(token_weighted(mean, torch.tensor(7.0, dtype=torch.float64), torch.tensor(13.0,
                       dtype=torch.float64), 3.0), token_weighted(mean, 7, 13, 3.0))


def test_routing_and_grouped_experts_read_nothing_on_the_host() -> None:
    from lightning_4d.expert_parallel import MoE

    torch.manual_seed(0)
    layer = MoE(16, 32, num_experts=4, top_k=2, aux_loss_coef=0.01, shared_hidden_dim=16, grouped_mm=True)
    x = torch.randn(2, 5, 16)
    with HostSyncCounter() as syncs:
        layer(x).sum().backward()
    assert syncs.count == 0, syncs.report()
    assert int(layer.tokens_per_expert.sum()) == 20


def test_the_expert_loop_copies_the_counts_once_per_layer() -> None:
    from lightning_4d.expert_parallel import swiglu_experts

    x = torch.randn(6, 4)
    w1, w2, w3 = torch.randn(3, 8, 4), torch.randn(3, 4, 8), torch.randn(3, 8, 4)
    counts = torch.tensor([1, 3, 2])
    with HostSyncCounter() as loop:
        looped = swiglu_experts(x, w1, w2, w3, counts, grouped_mm=False)
    with HostSyncCounter() as grouped:
        fused = swiglu_experts(x, w1, w2, w3, counts, grouped_mm=True)
    assert loop.kinds() == {"tolist": 1} and grouped.count == 0
    assert torch.equal(looped, fused)


def test_experts_run_in_the_autocast_dtype() -> None:
    # Under autocast the experts' fp32 weights run in bf16 like an nn.Linear's: on the grouped GEMM (no loop), and
    # the loop gives the same numbers.
    from lightning_4d.expert_parallel import grouped_linear

    x = torch.randn(6, 8)
    w = torch.randn(2, 16, 8, requires_grad=True)
    counts = torch.tensor([2, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with HostSyncCounter() as syncs:
            y = grouped_linear(x, w, counts)
        looped = grouped_linear(x, w, counts, grouped_mm=False)
        reference = torch.cat([F.linear(x[:2], w[0]), F.linear(x[2:], w[1])])
    assert syncs.count == 0 and y.dtype == looped.dtype == reference.dtype == torch.bfloat16
    assert torch.equal(y, looped) and torch.equal(y, reference)
    y.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


def test_clipping_and_the_guard_share_one_norm_and_read_it_once() -> None:
    from lightning_4d.runtime.step import clip_grad_norm, grad_norm_share
    from lightning_4d.safety.nonfinite import check_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model(torch.randn(3, 4)).square().sum().backward()
    ref = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for r, p in zip(ref, model.parameters()):
        r.grad = p.grad.clone()
    expected = torch.nn.utils.get_total_norm([r.grad for r in ref])
    params = list(model.parameters())
    with HostSyncCounter() as syncs:
        share = grad_norm_share(None, model, params)
        message = check_step(model, torch.tensor(1.0), 0, grad_norm_share=share.value)
        total = clip_grad_norm(None, model, params, max_norm=0.5, share=share)
    assert message is None and syncs.count == 1 and syncs.kinds() == {"tolist": 1}, syncs.report()
    assert torch.allclose(total, expected, rtol=1e-6)
    torch.nn.utils.clip_grads_with_norm_(ref, 0.5, total)  # torch's own rule with the same norm: the same bits
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), ref))
    assert float(total) > 0.5  # clipped: the norm after is max_norm
    assert abs(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])) - 0.5) < 1e-5


def test_the_guard_still_names_a_non_finite_gradient() -> None:
    from lightning_4d.runtime.step import grad_norm_share
    from lightning_4d.safety.nonfinite import check_step

    model = nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    model.bias.grad.fill_(float("inf"))
    share = grad_norm_share(None, model, model.parameters())
    message = check_step(model, torch.tensor(1.0), 3, grad_norm_share=share.value)
    assert message is not None and "global gradient norm at step 3" in message and "bias" in message
